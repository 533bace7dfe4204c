// attention and attention_varlen on CUDA, the host side: the problem's checks and
// layout, the choice of path and the launches of the kernels in
// kernels/cuda/attention.cuh (which describes them).
#include <type_traits>
#include <utility>

#include "attention.cuh"
#include "attention_problem.h"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "ops.h"

namespace fusedlm::cuda {
namespace {

using namespace kernels::attention;

// Whether the kernels can read or write t in place: head_dim contiguous and every row
// 16-byte aligned (cp.async and the paired stores).
bool kernel_layout(const at::Tensor& t) {
  if (t.stride(-1) != 1 || !aligned16(t.data_ptr())) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

at::Tensor with_kernel_layout(const at::Tensor& t) {
  if (kernel_layout(t)) return t;
  auto copy = at::empty(t.sizes(), t.options());
  return copy.copy_(t);
}

// Output `like`-laid-out tensors the kernels write into: the tensor itself, or a buffer
// whose contents `finish` copies back.
struct Output {
  at::Tensor tensor, buffer;
  explicit Output(at::Tensor t)
      : tensor(t), buffer(kernel_layout(t) ? t : at::empty(t.sizes(), t.options())) {}
  at::Tensor finish() {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    return tensor;
  }
};

// One call's inputs, checked, in the kernels' layout (see kernel_layout).
struct Problem : AttentionProblem {
  at::Tensor q, k, v, key_padding, cu_q, cu_k, seed;

  Problem(const AttentionProblem& shape, const at::Tensor& q_, const at::Tensor& k_,
          const at::Tensor& v_, const at::Tensor& seed_)
      : AttentionProblem(shape),
        q(with_kernel_layout(q_)),
        k(with_kernel_layout(k_)),
        v(with_kernel_layout(v_)),
        seed(seed_) {
    check_kernel_limits(q_);
  }

 private:
  // What the kernels are compiled for, and the grid's limits.
  void check_kernel_limits(const at::Tensor& q_) const {
    TORCH_CHECK_TYPE(q_.scalar_type() == at::kBFloat16 || q_.scalar_type() == at::kHalf,
                     "the cuda attention takes bfloat16 or float16");
    TORCH_CHECK_VALUE((dk == 64 || dk == 128) && dv == dk,
                      "the cuda attention takes a head_dim of 64 or 128 for q, k and v alike");
    TORCH_CHECK_VALUE(batch <= 65535 && heads <= 65535 && seq_q < (int64_t(1) << 31) &&
                          seq_k < (int64_t(1) << 31),
                      "the cuda attention's grid takes at most 65535 sequences and heads");
  }
};

Problem padded_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_padding_mask,
                       const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p,
                       double scale, const at::Tensor& seed) {
  TORCH_CHECK_VALUE(!present(attn_bias), "the cuda attention takes no attn_bias");
  Problem pb(padded_attention(q, k, v, key_padding_mask, causal, dropout_p, scale,
                              check_device_tensor),
             q, k, v, seed);
  if (present(key_padding_mask)) pb.key_padding = key_padding_mask->contiguous();
  return pb;
}

// The offsets are not checked against the tensors here: that would copy them to the host.
// A sequence longer than max_seqlen gets rows no block covers.
Problem varlen_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double dropout_p,
                       double scale, const at::Tensor& seed) {
  Problem pb(varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, dropout_p, scale, check_device_tensor),
             q, k, v, seed);
  pb.cu_q = cu_seqlens_q.contiguous();
  pb.cu_k = cu_seqlens_k.contiguous();
  return pb;
}

// Rows of a [batch, heads, seq, d] tensor, or of a packed [tokens, heads, d] one.
template <typename T>
Rows<T> rows_of(const at::Tensor& t, bool varlen) {
  T* p = ptr<T>(t);
  if (varlen) return {p, 0, t.stride(1), t.stride(0)};
  return {p, t.stride(0), t.stride(1), t.stride(2)};
}

// Rows of the float32 statistics: [batch, heads, seq_q], or [heads, tokens] (varlen).
Rows<float> stat_rows(const at::Tensor& t, bool varlen) {
  float* p = ptr<float>(t);
  if (varlen) return {p, 0, t.stride(0), t.stride(1)};
  return {p, t.stride(0), t.stride(1), t.stride(2)};
}

template <typename T>
Params<T> params(const Problem& pb) {
  Params<T> p;
  p.q = rows_of<const T>(pb.q, pb.varlen);
  p.k = rows_of<const T>(pb.k, pb.varlen);
  p.v = rows_of<const T>(pb.v, pb.varlen);
  p.key_padding = ptr<bool>(pb.key_padding);
  p.cu_q = pb.varlen ? ptr<int>(pb.cu_q) : nullptr;
  p.cu_k = pb.varlen ? ptr<int>(pb.cu_k) : nullptr;
  if (pb.varlen) {
    p.total_q = static_cast<int>(pb.q.size(0));
    p.total_k = static_cast<int>(pb.k.size(0));
  }
  p.heads = static_cast<int>(pb.heads);
  p.seq_q = static_cast<int>(pb.seq_q);
  p.seq_k = static_cast<int>(pb.seq_k);
  p.causal = pb.causal;
  p.scale = static_cast<float>(pb.scale);
  p.dropout = dropout_stream(pb.seed, pb.dropout_p);
  return p;
}

// Runs f(T{}, std::integral_constant<int, D>{}) for the problem's dtype and head dim.
template <typename F>
void dispatch_attention(const Problem& pb, F&& f) {
  auto with_dim = [&](auto tag) {
    if (pb.dk == 64) f(tag, std::integral_constant<int, 64>{});
    else f(tag, std::integral_constant<int, 128>{});
  };
  if (pb.q.scalar_type() == at::kBFloat16) with_dim(at::BFloat16{});
  else with_dim(at::Half{});
}

// Launches kernel over (blocks, heads, sequences).
template <typename T>
void launch_blocks(void (*kernel)(Params<T>), int64_t blocks, int threads, size_t smem,
                   const Problem& pb, const Params<T>& p) {
  if (blocks == 0 || pb.heads == 0 || pb.batch == 0) return;
  const Grid grid(blocks, pb.heads, pb.batch);
  launch(kernel, grid, threads, smem, p);
}

// Whether a kernel takes the resident path: when the rows it walks (keys, or queries for
// dK/dV) number at most kResidentMax and their tiles fit in shared memory, unless the
// attention_resident switch is off, which sends every sequence down the streamed path.
bool takes_resident_path(int64_t walked, size_t resident_smem) {
  return kernel_paths().attention_resident && walked <= kResidentMax &&
         resident_smem <= max_shared_memory();
}

// Launches kernel_of(path) over `own` rows a sequence (the queries of the forward and dQ
// kernels, the keys of dK/dV) on the path the sequence it walks takes. smem_of(path) is
// a block's shared memory on that path.
template <typename T, typename KernelOf, typename SmemOf>
void launch_path(KernelOf kernel_of, SmemOf smem_of, int64_t own, int64_t walked,
                 const Problem& pb, const Params<T>& p) {
  constexpr std::true_type resident;
  constexpr std::false_type streamed;
  if (takes_resident_path(walked, smem_of(resident)))
    launch_blocks<T>(kernel_of(resident), ceil_div(own, Shape<true>::rows),
                     Shape<true>::threads, smem_of(resident), pb, p);
  else
    launch_blocks<T>(kernel_of(streamed), ceil_div(own, Shape<false>::rows),
                     Shape<false>::threads, smem_of(streamed), pb, p);
}

void forward(const Problem& pb, const at::Tensor& out, const at::Tensor& lse) {
  dispatch_attention(pb, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    Params<T> p = params<T>(pb);
    p.out = rows_of<T>(out, pb.varlen);
    p.lse = stat_rows(lse, pb.varlen);
#if defined(FUSEDLM_SM90A)
    if (!takes_resident_path(pb.seq_k, forward_smem<D, true>(pb.seq_k)) &&
        hopper_path(kernel_paths().attention_wgmma)) {
      launch_blocks<T>(attention_forward_sm90_kernel<T, D>, ceil_div(pb.seq_q, kSm90Rows),
                       kSm90Threads, sm90_forward_smem<D>(), pb, p);
      return;
    }
#endif
    launch_path<T>(
        [](auto path) { return attention_forward_kernel<T, D, decltype(path)::value>; },
        [&](auto path) { return forward_smem<D, decltype(path)::value>(pb.seq_k); }, pb.seq_q,
        pb.seq_k, pb, p);
  });
}

void backward(const Problem& pb, const at::Tensor& grad, const at::Tensor& out,
              const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
              const at::Tensor& dv) {
  auto delta = at::empty(lse.sizes(), lse.options());
  dispatch_attention(pb, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    Params<T> p = params<T>(pb);
    p.out = rows_of<T>(out, pb.varlen);
    p.dout = rows_of<const T>(grad, pb.varlen);
    p.lse = stat_rows(lse, pb.varlen);
    p.delta = stat_rows(delta, pb.varlen);
    p.dq = rows_of<T>(dq, pb.varlen);
    p.dk = rows_of<T>(dk, pb.varlen);
    p.dv = rows_of<T>(dv, pb.varlen);
    p.own_delta = pb.seq_k <= kBlockN;
    if (!p.own_delta)
      launch_blocks<T>(attention_delta_kernel<T, D>,
                       ceil_div(pb.seq_q, kDeltaThreads / (D / 8)), kDeltaThreads, 0, pb, p);
    // With own_delta the dQ kernel stores the delta the dK/dV kernel reads.
    launch_path<T>(
        [](auto path) { return attention_dq_kernel<T, D, decltype(path)::value>; },
        [&](auto path) { return dq_smem<D, decltype(path)::value>(pb.seq_k); }, pb.seq_q,
        pb.seq_k, pb, p);
    launch_path<T>(
        [](auto path) { return attention_dkdv_kernel<T, D, decltype(path)::value>; },
        [&](auto path) { return dkdv_smem<D, decltype(path)::value>(pb.seq_q); }, pb.seq_k,
        pb.seq_q, pb, p);
  });
}

// The saved output and the incoming gradient, checked against the problem (with the
// log-sum-exp), in the kernels' layout.
std::pair<at::Tensor, at::Tensor> saved(const Problem& pb, const at::Tensor& q,
                                        const at::Tensor& grad, const at::Tensor& out,
                                        const at::Tensor& lse) {
  check_saved(pb, q, grad, out, lse, at::kFloat, check_device_tensor);
  return {with_kernel_layout(grad), with_kernel_layout(out)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, double dropout_p, double scale, const at::Tensor& seed) {
  const DeviceGuard guard(q, "q");
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed);
  Output out(empty_like_layout(q, q.sizes(), q.scalar_type()));
  auto lse = at::empty({pb.batch, pb.heads, pb.seq_q}, q.options().dtype(at::kFloat));
  forward(pb, out.buffer, lse);
  return {out.finish(), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p, double scale,
    const at::Tensor& seed, bool bias_grad) {
  const DeviceGuard guard(q, "q");
  TORCH_CHECK_VALUE(!bias_grad, "the cuda attention takes no attn_bias, so no bias gradient");
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed);
  const auto [g, o] = saved(pb, q, grad, out, lse);
  Output dq(empty_like_layout(q, q.sizes(), q.scalar_type()));
  Output dk(empty_like_layout(k, k.sizes(), k.scalar_type()));
  Output dv(empty_like_layout(v, v.sizes(), v.scalar_type()));
  backward(pb, g, o, lse, dq.buffer, dk.buffer, dv.buffer);
  return {dq.finish(), dk.finish(), dv.finish(), at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed) {
  const DeviceGuard guard(q, "q");
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, dropout_p, scale, seed);
  Output out(empty_like_layout(q, q.sizes(), q.scalar_type()));
  auto lse = at::empty({pb.heads, q.size(0)}, q.options().dtype(at::kFloat));
  forward(pb, out.buffer, lse);
  return {out.finish(), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed) {
  const DeviceGuard guard(q, "q");
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, dropout_p, scale, seed);
  const auto [g, o] = saved(pb, q, grad, out, lse);
  Output dq(empty_like_layout(q, q.sizes(), q.scalar_type()));
  Output dk(empty_like_layout(k, k.sizes(), k.scalar_type()));
  Output dv(empty_like_layout(v, v.sizes(), v.scalar_type()));
  backward(pb, g, o, lse, dq.buffer, dk.buffer, dv.buffer);
  return {dq.finish(), dk.finish(), dv.finish()};
}

}  // namespace fusedlm::cuda
