// gelu_ffn on CUDA, the host side: checks, operand layout, launches of the product
// kernels in kernels/cuda/gelu_ffn.cuh (which describes them), and the products and
// reductions left to cuBLAS and ATen.
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "gelu_ffn.cuh"
#include "ops.h"

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

// Runs f(T{}) for bf16 or fp16, the tensor cores' input types.
template <typename F>
void dispatch_half(at::ScalarType dtype, F&& f) {
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf,
                   "the cuda gelu_ffn takes bfloat16 or float16, got ", dtype);
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

}  // namespace fusedlm::cuda
