// cross_entropy and masked_lm_loss on CUDA.
//
// The fused classifier: one block per row of logits. A first sweep over the row keeps,
// per thread, an online log-sum-exp (a running max and the sum of exponentials rescaled
// to it, rescaled once per 16-byte vector) and, under label smoothing, the sum of the
// logits; the block combines the threads' pairs. A second sweep writes
// (softmax - target) * scale over the row, where the logits were when asked to (in
// place): the gradient comes out of the forward pass and the backward only rescales it.
// Rows are rarely 16-byte aligned (vocabularies of 30522 or 50257 classes), so each
// sweep takes the row's unaligned head and tail one element at a time and the rest in
// vectors. Traffic: two reads of the logits (the second mostly from L2: a block's row is
// 60-100 KiB in bf16) and one write of the gradient. llm.c's fused classifier is the
// reference point.
//
// Rows labelled ignore_index get a zero loss and gradient. The planner refuses a label
// outside [0, classes) before the kernel runs, except while torch.compile traces or a CUDA
// graph captures; then such a row gets a NaN loss, not a stray read.
//
// masked_lm_loss gathers the labelled rows and projects them chunk_rows at a time with
// ATen's matrix products into one reused logits buffer; the kernel overwrites each
// chunk's logits with their gradient, which the products fold into d_hidden and d_weight
// before the next chunk (csrc/cpu/cross_entropy.cpp does the same on the CPU).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "masked_lm.h"
#include "ops/compiled_kernel.h"

namespace fusedlm::cuda::kernels::cross_entropy {

constexpr int kThreads = 512;

// Dynamic shared memory of cross_entropy_kernel: block_lse's 3 * 32 floats.
constexpr size_t kSharedBytes = 3 * 32 * sizeof(float);

// Calls scalar(j) for the unaligned head and tail of a row of n elements that starts at
// element `start` of a 16-byte aligned buffer, and vector(j) for the N-element vectors
// between (N = 1: vector(j) for every element). Elements are spread over the block.
template <int N, typename Scalar, typename Vector>
__device__ __forceinline__ void walk_row(int64_t start, int64_t n, Scalar&& scalar,
                                         Vector&& vector) {
  const int64_t head = N > 1 ? std::min<int64_t>(n, (N - start % N) % N) : 0;
  const int64_t vecs = (n - head) / N;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) scalar(j);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) vector(head + v * N);
  for (int64_t j = head + vecs * N + threadIdx.x; j < n; j += blockDim.x) scalar(j);
}

// An online log-sum-exp: the sum of exp(x - max) over the values seen, and their max.
struct Lse {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;

  // Adds N values, rescaling the sum once. While every value is -inf the sum stays 0
  // (exp(-inf - -inf) would be NaN where the terms are 0).
  template <int N>
  __device__ __forceinline__ void add(const float (&x)[N]) {
    float m = x[0];
#pragma unroll
    for (int i = 1; i < N; ++i) m = fmaxf(m, x[i]);
    if (m > max) {
      sum *= __expf(max - m);
      max = m;
    }
    if (max == -std::numeric_limits<float>::infinity()) return;
#pragma unroll
    for (int i = 0; i < N; ++i) sum += __expf(x[i] - max);
  }

  __device__ __forceinline__ void merge(float other_max, float other_sum) {
    const float m = fmaxf(max, other_max);
    if (m == -std::numeric_limits<float>::infinity()) return;
    sum = sum * __expf(max - m) + other_sum * __expf(other_max - m);
    max = m;
  }
};

// Combines every thread's Lse and smoothing sum; every thread receives the results.
__device__ __forceinline__ void block_lse(Lse& lse, float& sum_x, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m = __shfl_xor_sync(0xffffffffu, lse.max, offset);
    const float s = __shfl_xor_sync(0xffffffffu, lse.sum, offset);
    lse.merge(m, s);
    sum_x += __shfl_xor_sync(0xffffffffu, sum_x, offset);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (lane == 0) {
    shared[warp] = lse.max;
    shared[32 + warp] = lse.sum;
    shared[64 + warp] = sum_x;
  }
  __syncthreads();
  lse = Lse();
  sum_x = 0.0f;
  if (lane < warps) {
    lse.max = shared[lane];
    lse.sum = shared[32 + lane];
    sum_x = shared[64 + lane];
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m = __shfl_xor_sync(0xffffffffu, lse.max, offset);
    const float s = __shfl_xor_sync(0xffffffffu, lse.sum, offset);
    lse.merge(m, s);
    sum_x += __shfl_xor_sync(0xffffffffu, sum_x, offset);
  }
}

// Row r of logits [rows, classes]: loss[r], and with grad (possibly logits itself)
// grad[r, j] = scale * row_scale[r] * (softmax_j - smoothing / classes - (1 - smoothing) [j == y]).
// scale is one float on the device (1 / labelled rows for "mean": no synchronisation).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(const T* logits, const int64_t* __restrict__ labels,
                         float* __restrict__ loss, T* grad, const float* __restrict__ scale,
                         const float* __restrict__ row_scale, int64_t classes,
                         int64_t ignore_index, float smoothing) {
  float* shared = reinterpret_cast<float*>(dynamic_shared_memory());  // kSharedBytes
  const int64_t row = blockIdx.x, start = row * classes;
  const T* x = logits + start;
  const int64_t label = labels[row];
  const bool ignored = label == ignore_index;
  const bool valid = 0 <= label && label < classes;

  if (ignored) {
    if (threadIdx.x == 0) loss[row] = 0.0f;
    if (!grad) return;
    T* g = grad + start;
    walk_row<N>(start, classes, [&](int64_t j) { g[j] = static_cast<T>(0.0f); },
                [&](int64_t j) {
                  const float zero[N] = {};
                  store<N>(g + j, zero);
                });
    return;
  }
  // Read before the block's first barrier: after it, the gradient may overwrite the logits.
  const float target = threadIdx.x == 0 && valid ? static_cast<float>(x[label]) : 0.0f;

  Lse lse;
  float sum_x = 0.0f;
  walk_row<N>(
      start, classes,
      [&](int64_t j) {
        const float v[1] = {static_cast<float>(x[j])};
        lse.add<1>(v);
        if (smoothing != 0.0f) sum_x += v[0];
      },
      [&](int64_t j) {
        float v[N];
        load<N>(x + j, v);
        lse.add<N>(v);
        if (smoothing != 0.0f) {
#pragma unroll
          for (int i = 0; i < N; ++i) sum_x += v[i];
        }
      });
  block_lse(lse, sum_x, shared);
  // The loss of a confident row is about sum - 1 (sum counts the max as exp(0) = 1):
  // --use_fast_math makes logf lg2.approx, whose absolute error near 1 (2^-21.4) can exceed
  // it, and leaves log1pf exact. sum - 1 is exact for sums up to 2.
  const float log_sum = log1pf(lse.sum - 1.0f), log_z = lse.max + log_sum;

  if (threadIdx.x == 0) {
    // torch's label smoothing: (1 - eps) * nll + eps * mean_j(-log softmax_j). Sums of
    // non-negative parts: log_z - target would keep only log_z's rounding of a small loss.
    float l = log_sum + (1.0f - smoothing) * (lse.max - target);
    if (smoothing != 0.0f) l += smoothing * (lse.max - sum_x / classes);
    loss[row] = valid ? l : std::numeric_limits<float>::quiet_NaN();
  }
  // block_lse's barrier came after every read of the first sweep: the gradient may now
  // overwrite the logits (each thread then reads an element just before writing it).
  if (!grad) return;
  const float s = scale[0] * (row_scale ? row_scale[row] : 1.0f);
  const float off = s * smoothing / classes, hit = s * (1.0f - smoothing);
  T* g = grad + start;
  auto grad_of = [&](float v, int64_t j) {
    return s * __expf(v - log_z) - off - (j == label ? hit : 0.0f);
  };
  walk_row<N>(
      start, classes,
      [&](int64_t j) { g[j] = static_cast<T>(grad_of(static_cast<float>(x[j]), j)); },
      [&](int64_t j) {
        float v[N];
        load<N>(x + j, v);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = grad_of(v[i], j + i);
        store<N>(g + j, v);
      });
}

// out = in * scale[row] (per_row, rows of `cols` elements) or in * scale[0]; N-element
// vectors never straddle two rows (cols % N == 0).
template <typename T, int N>
__global__ void scale_kernel(const T* __restrict__ in, T* __restrict__ out,
                             const float* __restrict__ scale, int64_t vecs, int64_t cols,
                             bool per_row) {
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += int64_t(gridDim.x) * blockDim.x) {
    const float s = scale[per_row ? v * N / cols : 0];
    float x[N];
    load<N>(in + v * N, x);
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] *= s;
    store<N>(out + v * N, x);
  }
}

}  // namespace fusedlm::cuda::kernels::cross_entropy

// --- host side: checks, launch shapes and launches ------------------------------------
// Also the kernel masked_lm_loss's chunked projections (csrc/masked_lm.cpp) run on each
// chunk.

namespace fusedlm::cuda {
namespace {

using namespace kernels::cross_entropy;

// The fused kernel over logits2 [rows, classes] (contiguous) and labels1 [rows]: losses
// (float32, rows elements, contiguous) receive the losses; grad is undefined (loss only) or
// the contiguous memory of rows * classes elements, possibly logits2 itself; scale is a
// one-element float32 tensor, row_scale undefined or float32 [rows].
void run_kernel(const at::Tensor& logits2, const at::Tensor& labels1, const at::Tensor& losses,
                const at::Tensor& grad, const at::Tensor& scale, const at::Tensor& row_scale,
                int64_t ignore_index, double label_smoothing) {
  const int64_t rows = logits2.size(0), classes = logits2.size(1);
  if (rows == 0) return;
  dispatch(logits2.scalar_type(), "logits", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* xp = ptr<T>(logits2);
    T* gp = ptr<T>(grad);
    // Each row's misalignment is then the same in both buffers.
    const bool vector = all_aligned16(xp, gp);
    const int threads = static_cast<int>(
        std::min<int64_t>(kThreads, ceil_div(ceil_div(classes, vector ? V : 1), 32) * 32));
    const int64_t* lp = ptr<int64_t>(labels1);
    float *loss = ptr<float>(losses), *sp = ptr<float>(scale), *rs = ptr<float>(row_scale);
    if (vector)
      launch(cross_entropy_kernel<T, V>, rows, threads, kSharedBytes, xp, lp, loss, gp, sp, rs,
             classes, ignore_index, float(label_smoothing));
    else
      launch(cross_entropy_kernel<T, 1>, rows, threads, kSharedBytes, xp, lp, loss, gp, sp, rs,
             classes, ignore_index, float(label_smoothing));
  });
}

// src * scale rounded once to src's dtype; scale (float32 on the device) holds one value,
// or one per row of src viewed as [scale.numel(), -1]. Undefined for an undefined src.
at::Tensor scaled(const at::Tensor& src, const at::Tensor& scale) {
  if (!src.defined()) return src;
  auto in = src.contiguous();
  auto out = at::empty_like(in);
  const int64_t n = in.numel();
  if (n == 0) return out;
  const bool per_row = scale.numel() > 1;
  const int64_t cols = per_row ? n / scale.numel() : n;
  dispatch(in.scalar_type(), "the gradient", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* ip = ptr<T>(in);
    T* op = ptr<T>(out);
    const bool vector = cols % V == 0 && all_aligned16(ip, op);
    const int64_t vecs = vector ? n / V : n;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(vecs, threads), int64_t(multiprocessors()) * 8);
    const float* sp = ptr<float>(scale);
    if (vector)
      launch(scale_kernel<T, V>, blocks, threads, 0, ip, op, sp, vecs, cols, per_row);
    else
      launch(scale_kernel<T, 1>, blocks, threads, 0, ip, op, sp, vecs, cols, per_row);
  });
  return out;
}

// The loss a reduction returns from the per-row losses (float32); labelled: how many rows
// count for the mean (a device tensor, so nothing synchronises).
at::Tensor reduce_losses(const at::Tensor& losses, Reduction reduction, const at::Tensor& labelled) {
  auto total = losses.sum(at::kDouble);
  if (reduction == Reduction::kMean) total = total / labelled.clamp_min(1).to(at::kDouble);
  return total.to(at::kFloat);
}

at::Tensor unit_scale(const at::Tensor& like, double value) {
  return at::full({1}, value, like.options().dtype(at::kFloat));
}

// The one synchronisation of masked_lm_loss: the labelled rows' count sizes every chunk.
at::Tensor labelled_positions(const at::Tensor& labels1, int64_t, int64_t ignore_index) {
  return at::nonzero(labels1 != ignore_index).view(-1);
}

at::Tensor chunk_cross_entropy(const at::Tensor& logits, const at::Tensor& labels1,
                               const at::Tensor& losses, bool with_grad, bool col_sum,
                               int64_t ignore_index, double label_smoothing, double grad_scale,
                               const at::Tensor& row_scale) {
  run_kernel(logits, labels1, losses, with_grad ? logits : at::Tensor(),
             unit_scale(logits, grad_scale), row_scale, ignore_index, label_smoothing);
  return col_sum ? logits.sum(0, false, at::kFloat) : at::Tensor();
}

// masked_lm_loss's reduction, whose count of labelled rows the host already holds.
at::Tensor reduce_labelled(const at::Tensor& losses, Reduction reduction, int64_t labelled) {
  auto total = losses.sum(at::kDouble);
  if (reduction == Reduction::kMean) total = total / double(std::max<int64_t>(labelled, 1));
  return total.to(losses.scalar_type());
}

const MlmBackend kCudaMlm{check_device_tensor, labelled_positions, chunk_cross_entropy,
                          reduce_labelled, scaled};

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad) {
  const auto in = cross_entropy_inputs(logits, labels, reduction, check_device_tensor);
  const DeviceGuard guard(logits);
  const auto labelled = (in.labels != ignore_index).sum();
  const auto scale = in.reduction == Reduction::kMean
                         ? at::reciprocal(labelled.clamp_min(1).to(at::kFloat)).view({1})
                         : unit_scale(in.logits, 1.0);
  // Outputs in their final shapes, contiguous (the kernel writes them as rows): an op's
  // output must not be a view.
  auto losses = at::empty(labels.sizes(), in.logits.options().dtype(at::kFloat));
  auto grad = with_grad ? at::empty(logits.sizes(), in.logits.options()) : at::Tensor();
  run_kernel(in.logits, in.labels, losses, grad, scale, at::Tensor(), ignore_index,
             label_smoothing);
  return {in.reduction == Reduction::kNone ? losses : reduce_losses(losses, in.reduction, labelled),
          with_grad ? grad : nothing(logits)};
}
FUSEDLM_KERNEL(cross_entropy_forward);

at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& saved_grad,
                                  const std::string& reduction) {
  check_cross_entropy_grad(grad, saved_grad, reduction, check_device_tensor);
  const DeviceGuard guard(saved_grad);
  return scaled(saved_grad, grad.to(at::kFloat).contiguous());
}
FUSEDLM_KERNEL(cross_entropy_backward);

constexpr auto masked_lm_loss_forward = &MaskedLmLoss<kCudaMlm, DeviceGuard>::forward;
FUSEDLM_KERNEL(masked_lm_loss_forward);
constexpr auto masked_lm_loss_backward = &MaskedLmLoss<kCudaMlm, DeviceGuard>::backward;
FUSEDLM_KERNEL(masked_lm_loss_backward);

}  // namespace fusedlm::cuda
