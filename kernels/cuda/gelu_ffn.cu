// gelu_ffn on CUDA: Linear(w1, b1) -> GELU -> dropout -> Linear(w2, b2), on one of two
// paths (the ffn_cublas switch, on unless FUSEDLM_FFN_CUBLAS=0).
//
// cuBLAS (the default): both products are cuBLAS's (at::addmm), and the bias is in the
// first one's epilogue; one elementwise pass (bias_gelu.cu's kernels, with dropout) turns
// the pre-activation into act = dropout(gelu(pre)), and in the backward one pass turns
// dact = dy w2 into dpre = dact * keep / (1 - p) * gelu'(pre) with act again (for dw2)
// and the column sums of dpre for db1. Against eager PyTorch it saves dropout's own pass
// and mask, and the backward's separate GELU-gradient and bias-gradient passes.
//
// Fused products (FUSEDLM_FFN_CUBLAS=0): the bias, GELU and dropout in the epilogue of
// the first matrix product and their backward in the epilogue of the product that gives
// the activation's gradient.
// Forward:  one tensor-core product x w1^T whose epilogue writes pre = x w1^T + b1 (saved
//   for backward, bias included) and act = dropout(gelu(pre)); then y = act w2^T + b2
//   (cuBLAS, at::addmm).
// Backward: one tensor-core product dy w2 whose epilogue writes
//   dpre = (dy w2) * keep / (1 - p) * gelu'(pre), and act again from pre (for dw2, instead
//   of keeping it from the forward), and sums dpre's columns per block for db1 (a second
//   kernel sums the blocks: no atomics, the bias gradient repeats bit for bit); then
//   dx = dpre w1, dw1 = dpre^T x, dw2 = dy^T act and db2 (cuBLAS and ATen).
// Either epilogue replaces an elementwise pass that would read the product back from
// memory: per element it costs one Philox call when dropout is on, and pair stores.
//
// The product C = A B: A [M, K] row-major; B [N, K] row-major (w1, the forward) or
// [K, N] row-major (w2, the backward). A block of 8 warps computes a 128 x 128 tile of
// C, each warp 64 x 32 of it as 4 x 4 m16n8k16 fragments (64 float accumulators a
// thread); K advances 32 at a time through a 3-stage cp.async pipeline of shared tiles
// (60 KiB), two blocks an SM. On sm_90 (a build with sm_90a code) the same tile runs on
// Hopper's warpgroup products instead (ffn_product_sm90_kernel), unless
// FUSEDLM_FFN_WGMMA=0. Limits: no TMA or warp specialisation on sm_90 (each k-step's
// products are waited for before the next are issued; the other block on the SM fills
// the gap), no split-K for small M, and the epilogue stores element pairs straight from
// the fragments rather than staging 16-byte rows.
//
// Both paths take bf16 and fp16 with d_in, d_ff and d_out multiples of 8 (16-byte rows
// for cp.async); the Python limits route other calls to the triton backend. Both number
// the dropout stream over [rows, d_ff] row-major, so they drop the same elements.
#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "gelu.cuh"
#include "ops/compiled_kernel.h"
#include "tensor_core.cuh"
#include "wgmma.cuh"

namespace fusedlm::cuda::kernels::gelu_ffn {

using namespace tc;

constexpr int kThreads = 256;  // 8 warps: 2 along M x 4 along N
constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 32;
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kStages = 3;
constexpr int kPitchK = kBlockK + 8;  // shared pitch of tiles whose rows run along K
constexpr int kPitchN = kBlockN + 8;  // shared pitch of the backward's [K, N] tile of B
constexpr int kTileA = kBlockM * kPitchK;

template <bool kBackward>
constexpr int kTileB = kBackward ? kBlockK * kPitchN : kBlockN * kPitchK;

template <bool kBackward>
constexpr size_t shared_bytes(size_t element) {
  return kStages * (kTileA + kTileB<kBackward>) * element;
}

template <typename T>
struct Params {
  const T* a = nullptr;  // [m, k]
  const T* b = nullptr;  // [n, k] (forward) or [k, n] (backward)
  int64_t m = 0, n = 0, k = 0;
  const T* bias = nullptr;      // forward: b1 [n], or null
  T* pre = nullptr;             // [m, n]: written by the forward, read by the backward
  T* act = nullptr;             // [m, n]: dropout(gelu(pre))
  T* dpre = nullptr;            // backward: [m, n]
  float* dbias_part = nullptr;  // backward: [m blocks, n] column sums of dpre, or null
  Dropout dropout;
};

// The 64 x 32 share of warp (wm, wn) of the block's tile C = A B, in m16n8k16 C
// fragments: acc[mt][nt] is rows wm * 64 + mt * 16 (+8), columns wn * 32 + nt * 8.
template <typename T, bool kBackward>
__device__ __forceinline__ void block_product(const Params<T>& p, T* tiles_a, T* tiles_b,
                                              int64_t m0, int64_t n0, int wm, int wn,
                                              float (&acc)[4][4][4]) {
  const int k_tiles = static_cast<int>((p.k + kBlockK - 1) / kBlockK);
  auto load_stage = [&](int kt) {
    const int s = kt % kStages;
    const int64_t k0 = int64_t(kt) * kBlockK;
    load_tile_2d<kBlockM, kBlockK, kThreads>(tiles_a + s * kTileA, p.a + m0 * p.k + k0, p.k,
                                             p.m - m0, p.k - k0);
    T* tile_b = tiles_b + s * kTileB<kBackward>;
    if constexpr (kBackward)
      load_tile_2d<kBlockK, kBlockN, kThreads>(tile_b, p.b + k0 * p.n + n0, p.n, p.k - k0,
                                               p.n - n0);
    else
      load_tile_2d<kBlockN, kBlockK, kThreads>(tile_b, p.b + n0 * p.k + k0, p.k, p.n - n0,
                                               p.k - k0);
  };
  // Stages in flight: kStages - 1 ahead of the one being multiplied. Every iteration
  // commits a group (empty past the last tile) so that the wait counts stay exact.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    // Tile kt has landed for every thread, and every warp is done with the stage the
    // next load overwrites (it held tile kt - 1).
    __syncthreads();
    if (kt + kStages - 1 < k_tiles) load_stage(kt + kStages - 1);
    cp_async_commit();
    const T* ta = tiles_a + (kt % kStages) * kTileA;
    const T* tb = tiles_b + (kt % kStages) * kTileB<kBackward>;
#pragma unroll
    for (int kk = 0; kk < kBlockK; kk += 16) {
      uint32_t a[4][4], b[2][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) load_a<kPitchK>(a[mt], ta, wm * kWarpM + mt * 16, kk);
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        if constexpr (kBackward)
          load_b_cols<kPitchN>(b[pair], tb, kk, wn * kWarpN + pair * 16);
        else
          load_b_rows<kPitchK>(b[pair], tb, wn * kWarpN + pair * 16, kk);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma<T>(acc[mt][nt], a[mt], b[nt / 2][2 * (nt % 2)], b[nt / 2][2 * (nt % 2) + 1]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the shared tiles are free for the epilogue
}

// The epilogue of one row's column pair (col, col + 1) of C, c its two values: the
// forward writes pre = c + bias and act; the backward writes act (again, from pre) and
// dpre, and adds dpre into colsum (for db1).
template <typename T, bool kBackward, bool kTanh>
__device__ __forceinline__ void epilogue_pair(const Params<T>& p, int64_t row, int64_t col,
                                              const float* c, const float (&bias)[2],
                                              float (&colsum)[2]) {
  const int64_t at = row * p.n + col;
  bool kept[2] = {true, true};
  if (p.dropout.active) keep_pair(p.dropout, static_cast<uint64_t>(at), kept);
  // The pre-activation as stored: the backward recomputes act from that, so both
  // passes see the same act bit for bit.
  float z[2];
  if constexpr (kBackward) {
    load<2>(p.pre + at, z);
  } else {
    z[0] = rounded<T>(c[0] + bias[0]);
    z[1] = rounded<T>(c[1] + bias[1]);
    store<2>(p.pre + at, z);
  }
  float act[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) act[j] = kept[j] ? gelu<kTanh>(z[j]) * p.dropout.scale : 0.0f;
  store<2>(p.act + at, act);
  if constexpr (kBackward) {
    float d[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      d[j] = kept[j] ? c[j] * p.dropout.scale * gelu_grad<kTanh>(z[j]) : 0.0f;
      colsum[j] += d[j];
    }
    store<2>(p.dpre + at, d);
  }
}

template <typename T, bool kBackward>
__device__ __forceinline__ void load_bias(const Params<T>& p, int64_t col, float (&bias)[2]) {
  bias[0] = bias[1] = 0.0f;
  if (!kBackward && p.bias != nullptr) load<2>(p.bias + col, bias);
}

// A warp's column total (the lanes 4 apart share columns: every g of one t) into
// sums[col] of its row of warps. sums: [warps along M][kBlockN] floats in shared memory.
__device__ __forceinline__ void warp_column_total(float v, float* sums, int col) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  if (threadIdx.x % 32 < 4) sums[col] = v;
}

// The block's column sums of dpre, the warps along M added in a fixed order (no atomics:
// db1 repeats bit for bit), as row blockIdx.y of dbias_part.
template <int kWarpsM, typename T>
__device__ __forceinline__ void store_column_sums(const Params<T>& p, const float* sums,
                                                  int64_t n0) {
  __syncthreads();
  const int c = threadIdx.x;
  if (c >= kBlockN || n0 + c >= p.n) return;
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarpsM; ++w) total += sums[w * kBlockN + c];
  p.dbias_part[int64_t(blockIdx.y) * p.n + n0 + c] = total;
}

// grid: (column blocks, row blocks). Forward (kBackward false): C = x w1^T, writes pre
// and act. Backward: C = dy w2, writes dpre and act, and dbias_part.
template <typename T, bool kBackward, bool kTanh>
__global__ void __launch_bounds__(kThreads, 2) ffn_product_kernel(const Params<T> p) {
  unsigned char* smem = dynamic_shared_memory();
  T* tiles_a = reinterpret_cast<T*>(smem);
  T* tiles_b = tiles_a + kStages * kTileA;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / 4, wn = warp % 4, g = lane / 4, t = lane % 4;
  const int64_t m0 = int64_t(blockIdx.y) * kBlockM, n0 = int64_t(blockIdx.x) * kBlockN;

  float acc[4][4][4] = {};
  block_product<T, kBackward>(p, tiles_a, tiles_b, m0, n0, wm, wn, acc);

  // Thread (g, t) holds columns 2t, 2t + 1 of each n-tile in rows g and g + 8 of each
  // m-tile. With n a multiple of 8 a column pair is wholly inside or outside.
  float colsum[4][2] = {};
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int64_t col = n0 + wn * kWarpN + nt * 8 + 2 * t;
    if (col >= p.n) continue;
    float bias[2];
    load_bias<T, kBackward>(p, col, bias);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm * kWarpM + mt * 16 + g + 8 * h;
        if (row < p.m)
          epilogue_pair<T, kBackward, kTanh>(p, row, col, &acc[mt][nt][2 * h], bias, colsum[nt]);
      }
    }
  }
  if constexpr (kBackward) {
    if (p.dbias_part == nullptr) return;
    float* sums = reinterpret_cast<float*>(smem);  // [2][kBlockN]
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        warp_column_total(colsum[nt][j], sums + wm * kBlockN, wn * kWarpN + nt * 8 + 2 * t + j);
    store_column_sums<2>(p, sums, n0);
  }
}

// The same product on Hopper's warpgroup products (wgmma.cuh), on sm_90a: two
// warpgroups, each 64 rows of the 128 x 128 tile of C as two m64n64 accumulators (the
// columns 0-63 and 64-127), read A and B from 128-byte-swizzled shared tiles 64 wide along
// K (one swizzle panel), kSm90Stages of them in flight through cp.async. B is read
// K-major in the forward (w1 [N, K]) and MN-major in the backward (w2 [K, N]). The
// accumulators have the mma.sync C fragments' layout, so the epilogue is the same.
constexpr int kSm90BlockK = 64;
constexpr int kSm90Stages = 3;
constexpr int kSm90Tile = kBlockM * kSm90BlockK;  // A's and B's (kBlockN = kBlockM)
static_assert(kBlockN == kBlockM, "A and B tiles of one size");

constexpr size_t sm90_shared_bytes(size_t element) {
  return kSm90Stages * 2 * kSm90Tile * element + 1024;  // 1 KiB to align the swizzle
}

template <typename T, bool kBackward, bool kTanh>
__global__ void __launch_bounds__(kThreads, 2) ffn_product_sm90_kernel(const Params<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  unsigned char* sm90_smem = dynamic_shared_memory();
  const uint32_t align = (1024 - smem_address(sm90_smem) % 1024) % 1024;
  T* tiles_a = reinterpret_cast<T*>(sm90_smem + align);  // [stages][kBlockM][64], swizzled
  T* tiles_b = tiles_a + kSm90Stages * kSm90Tile;       // [stages][kBlockN][64] or [64][kBlockN]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group_row = warp / 4 * 64;  // the warpgroup's first row in the block
  const int64_t m0 = int64_t(blockIdx.y) * kBlockM, n0 = int64_t(blockIdx.x) * kBlockN;
  const int k_tiles = static_cast<int>((p.k + kSm90BlockK - 1) / kSm90BlockK);

  auto load_stage = [&](int kt) {
    const int64_t k0 = int64_t(kt) * kSm90BlockK;
    T* tile_b = tiles_b + kt % kSm90Stages * kSm90Tile;
    wg::load_tile_2d<kBlockM, kSm90BlockK, kThreads>(tiles_a + kt % kSm90Stages * kSm90Tile,
                                                     p.a + m0 * p.k + k0, p.k, p.m - m0,
                                                     p.k - k0);
    if constexpr (kBackward)
      wg::load_tile_2d<kSm90BlockK, kBlockN, kThreads>(tile_b, p.b + k0 * p.n + n0, p.n,
                                                       p.k - k0, p.n - n0);
    else
      wg::load_tile_2d<kBlockN, kSm90BlockK, kThreads>(tile_b, p.b + n0 * p.k + k0, p.k,
                                                       p.n - n0, p.k - k0);
  };
  // Stages in flight: kSm90Stages - 1 ahead of the one being multiplied. Every iteration
  // commits a group (empty past the last tile) so that the wait counts stay exact.
#pragma unroll
  for (int s = 0; s < kSm90Stages - 1; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }
  float acc[2][8][4] = {};  // columns 0-63, 64-127
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kSm90Stages - 2>();
    wg::fence_shared_for_async();
    // Tile kt has landed for every thread, and every warpgroup is done with the stage the
    // next load overwrites (its products on tile kt - 1 were waited for).
    __syncthreads();
    if (kt + kSm90Stages - 1 < k_tiles) load_stage(kt + kSm90Stages - 1);
    cp_async_commit();
    const T* ta = tiles_a + kt % kSm90Stages * kSm90Tile;
    const T* tb = tiles_b + kt % kSm90Stages * kSm90Tile;
    wg::pin(acc[0]);
    wg::pin(acc[1]);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < kSm90BlockK / 16; ++kk) {
      const uint64_t a = wg::k_major<kBlockM>(ta, group_row, kk);
      // Columns 64 half .. 64 half + 63 of C: in the backward, panel `half` of w2's tile
      // [64 k][128 n]; in the forward, rows 64 half .. of w1's tile [128 n][64 k].
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if constexpr (kBackward)
          wg::mma_ss<T, true>(acc[half], a,
                              wg::mn_major<kSm90BlockK>(tb + half * kSm90BlockK * 64, kk), 1);
        else
          wg::mma_ss<T>(acc[half], a, wg::k_major<kBlockN>(tb, half * 64, kk), 1);
      }
    }
    wg::commit();
    wg::wait<0>();
    wg::pin(acc[0]);
    wg::pin(acc[1]);
  }
  cp_async_wait<0>();
  __syncthreads();  // the shared tiles are free for the column sums

  // Warp w holds rows 16w + g, 16w + g + 8 of the block, columns 64 half + 8 nt + 2t, + 1.
  float* sums = reinterpret_cast<float*>(tiles_a);  // [8][kBlockN]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int block_col = half * 64 + nt * 8 + 2 * t;
      const int64_t col = n0 + block_col;
      float colsum[2] = {0.0f, 0.0f};
      if (col < p.n) {
        float bias[2];
        load_bias<T, kBackward>(p, col, bias);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = m0 + warp * 16 + g + 8 * h;
          if (row < p.m)
            epilogue_pair<T, kBackward, kTanh>(p, row, col, &acc[half][nt][2 * h], bias, colsum);
        }
      }
      if (kBackward && p.dbias_part != nullptr) {
        warp_column_total(colsum[0], sums + warp * kBlockN, block_col);
        warp_column_total(colsum[1], sums + warp * kBlockN, block_col + 1);
      }
    }
  }
  if (kBackward && p.dbias_part != nullptr) store_column_sums<kThreads / 32>(p, sums, n0);
#else
  __trap();  // launched only on devices the sm_90a code was built for
#endif
}

}  // namespace fusedlm::cuda::kernels::gelu_ffn

// --- host side: checks, launch shapes and launches ------------------------------------
// Operand layout, launches of the product kernels, and the products and reductions left
// to cuBLAS and ATen.

namespace fusedlm::cuda {
namespace {

using namespace kernels::gelu_ffn;

// The product of p on the path the device takes: the wgmma kernel or the mma.sync one.
template <typename T, bool kBackward>
void run_product(const Params<T>& p, bool approx_tanh) {
  if (p.m == 0 || p.n == 0) return;
  const bool hopper = hopper_path(kernel_paths().ffn_wgmma);
  auto kernel = hopper ? (approx_tanh ? ffn_product_sm90_kernel<T, kBackward, true>
                                      : ffn_product_sm90_kernel<T, kBackward, false>)
                       : (approx_tanh ? ffn_product_kernel<T, kBackward, true>
                                      : ffn_product_kernel<T, kBackward, false>);
  const size_t smem = hopper ? sm90_shared_bytes(sizeof(T)) : shared_bytes<kBackward>(sizeof(T));
  const Grid grid(ceil_div(p.n, kBlockN), ceil_div(p.m, kBlockM));
  launch(kernel, grid, kThreads, smem, p);
}

// The [m, k] x [k, n] product of a and b (laid out as the kernels say) with the GELU of
// the pre-activation and its dropout, both passes'.
template <typename T>
Params<T> product(const at::Tensor& a, const at::Tensor& b, int64_t m, int64_t n, int64_t k,
                  const at::Tensor& pre, const at::Tensor& act, const at::Tensor& seed,
                  double dropout_p) {
  Params<T> p;
  p.a = ptr<T>(a);
  p.b = ptr<T>(b);
  p.m = m, p.n = n, p.k = k;
  p.pre = ptr<T>(pre);
  p.act = ptr<T>(act);
  p.dropout = dropout_stream(seed, dropout_p);
  return p;
}

void check_half(at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf,
                   "the cuda gelu_ffn takes bfloat16 or float16, got ", dtype);
}

// Runs f(T{}) for bf16 or fp16, the tensor cores' input types.
template <typename F>
void dispatch_half(at::ScalarType dtype, F&& f) {
  check_half(dtype);
  if (dtype == at::kBFloat16) f(at::BFloat16{});
  else f(at::Half{});
}

// t (contiguous) 16-byte aligned for cp.async: itself, or an aligned copy. Undefined stays so.
at::Tensor aligned(const at::Tensor& t) {
  return !t.defined() || aligned16(t.data_ptr()) ? t : t.clone();
}

void check_sizes(int64_t d_in, int64_t d_ff, int64_t d_out) {
  TORCH_CHECK_VALUE(d_in % 8 == 0 && d_ff % 8 == 0 && d_out % 8 == 0,
                    "the cuda gelu_ffn takes d_in, d_ff and d_out that are multiples of 8, got ",
                    d_in, ", ", d_ff, ", ", d_out);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed) {
  const auto in = gelu_ffn_inputs(x, w1, b1, w2, b2, approximate, check_device_tensor);
  const DeviceGuard guard(x);
  const auto x2 = aligned(in.x), w1c = aligned(in.w1), b1c = aligned(in.b1);
  const int64_t rows = x2.size(0), d_in = x2.size(1), d_ff = w1c.size(0), d_out = in.w2.size(0);
  check_sizes(d_in, d_ff, d_out);
  check_half(x.scalar_type());
  if (kernel_paths().ffn_cublas) {
    const auto w1t = w1c.t();
    const auto pre = b1c.defined() ? at::addmm(b1c, x2, w1t) : at::mm(x2, w1t);
    auto act = at::empty_like(pre);
    gelu_forward_pass(pre, at::Tensor(), act, in.tanh, dropout_stream(seed, dropout_p));
    return {ffn_output(x, act, in.w2, in.b2), pre};
  }
  auto pre = at::empty({rows, d_ff}, x2.options());
  auto act = at::empty_like(pre);
  dispatch_half(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    Params<T> p = product<T>(x2, w1c, rows, d_ff, d_in, pre, act, seed, dropout_p);
    p.bias = ptr<T>(b1c);
    run_product<T, false>(p, in.tanh);
  });
  return {ffn_output(x, act, in.w2, in.b2), pre};
}
FUSEDLM_KERNEL(gelu_ffn_forward);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed) {
  const auto in = gelu_ffn_grad_inputs(grad, x, pre_activation, w1, b1, w2, b2, approximate,
                                       check_device_tensor);
  const DeviceGuard guard(x);
  const auto g2 = aligned(in.grad), w2c = aligned(in.w2), pre = aligned(in.pre_activation);
  const int64_t rows = in.x.size(0), d_in = in.x.size(1), d_ff = in.w1.size(0), d_out = w2c.size(0);
  check_sizes(d_in, d_ff, d_out);
  const bool has_b1 = in.b1.defined();
  auto dpre = at::empty_like(pre);
  auto act = at::empty_like(pre);
  at::Tensor db1;
  check_half(x.scalar_type());
  if (kernel_paths().ffn_cublas) {
    db1 = gelu_backward_pass(at::mm(g2, w2c), pre, at::Tensor(), dpre, act, in.tanh,
                             dropout_stream(seed, dropout_p), has_b1);
    const auto g = ffn_backward_products(in, x, g2, act, dpre);
    return {g.dx, g.dw1, db1, g.dw2, g.db2};
  }
  dispatch_half(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto part = at::empty({has_b1 ? ceil_div(rows, kBlockM) : 0, d_ff},
                          pre.options().dtype(at::kFloat));
    Params<T> p = product<T>(g2, w2c, rows, d_ff, d_out, pre, act, seed, dropout_p);
    p.dpre = ptr<T>(dpre);
    p.dbias_part = has_b1 ? ptr<float>(part) : nullptr;
    run_product<T, true>(p, in.tanh);
    if (has_b1) db1 = sum_partials<T>(part, x.scalar_type());
  });
  const auto g = ffn_backward_products(in, x, g2, act, dpre);
  return {g.dx, g.dw1, db1, g.dw2, g.db2};
}
FUSEDLM_KERNEL(gelu_ffn_backward);

}  // namespace fusedlm::cuda
