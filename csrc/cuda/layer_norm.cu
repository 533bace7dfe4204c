// add_layer_norm on CUDA, the host side: checks, launch shapes and launches of the
// kernels in kernels/cuda/layer_norm.cuh (which describes them).
#include <algorithm>

#include "cuda/common.h"
#include "cuda/runtime.h"
#include "layer_norm.cuh"
#include "ops.h"

namespace fusedlm::cuda {

using namespace kernels::layer_norm;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed) {
  const auto in = add_layer_norm_inputs(x, residual, weight, bias, check_device_tensor);
  const DeviceGuard guard(x);
  const Dropout dropout = dropout_stream(seed, dropout_p);

  const int64_t rows = in.x.size(0), cols = in.x.size(1);
  // Outputs in x's shape (contiguous, so the kernels see [rows, cols]): an op's output
  // must not be a view.
  auto out = at::empty(x.sizes(), in.x.options()), summed = at::empty(x.sizes(), in.x.options());
  auto mean = at::empty({rows}, in.x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (rows == 0) return;
    const T *xp = ptr<T>(in.x), *rp = ptr<T>(in.residual), *wp = ptr<T>(in.weight);
    const T* bp = ptr<T>(in.bias);
    T *op = ptr<T>(out), *sp = ptr<T>(summed);
    constexpr int V = kVec<T>;
    if (cols % V == 0 && all_aligned16(xp, rp, wp, bp, op, sp)) {
      launch(add_layer_norm_forward_kernel<T, V>, rows, row_threads(cols / V, kForwardCache),
             kSharedBytes, xp, rp, wp, bp, op, sp, ptr<float>(mean), ptr<float>(rstd), cols,
             float(eps), dropout);
    } else {
      launch(add_layer_norm_forward_kernel<T, 1>, rows, row_threads(cols, kForwardCache),
             kSharedBytes, xp, rp, wp, bp, op, sp, ptr<float>(mean), ptr<float>(rstd), cols,
             float(eps), dropout);
    }
  });
  return {out, summed, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed) {
  const auto in = add_layer_norm_grad_inputs(grad_out, grad_summed, summed, mean, rstd, weight,
                                             at::kFloat, dropout_p > 0, has_residual,
                                             check_device_tensor);
  const DeviceGuard guard(summed);
  const Dropout dropout = dropout_stream(seed, dropout_p);

  const int64_t rows = in.summed.size(0), cols = in.summed.size(1);
  const auto options = in.summed.options();
  at::Tensor dweight, dbias;
  dispatch(summed.scalar_type(), "summed", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T *gp = ptr<T>(in.grad_out), *gsp = ptr<T>(in.grad_summed), *sp = ptr<T>(in.summed);
    const T* wp = ptr<T>(in.weight);
    T *dsp = ptr<T>(in.dsummed), *dxp = ptr<T>(in.dx);
    const bool vector = cols % V == 0 && all_aligned16(gp, gsp, sp, wp, dsp, dxp);
    const int threads = row_threads(vector ? cols / V : cols, kBackwardCache);
    // Enough blocks to fill the device, but at least 8 rows each, so the partial sums
    // stay small next to the rows themselves. Fixed per shape and device.
    const int64_t resident = int64_t(multiprocessors()) * std::max(1, std::min(16, 2048 / threads));
    const int64_t rows_per_block = std::max<int64_t>(8, ceil_div(rows, resident));
    const int64_t blocks = ceil_div(rows, rows_per_block);
    auto partial = options.dtype(at::kFloat);
    auto dw_part = at::empty({in.weight.defined() ? blocks : 0, cols}, partial);
    auto db_part = at::empty({has_bias ? blocks : 0, cols}, partial);
    if (rows > 0) {
      float *dwp = in.weight.defined() ? ptr<float>(dw_part) : nullptr;
      float *dbp = has_bias ? ptr<float>(db_part) : nullptr;
      if (vector)
        launch(add_layer_norm_backward_kernel<T, V>, blocks, threads, kSharedBytes, gp, gsp, sp,
               ptr<float>(mean), ptr<float>(rstd), wp, dsp, dxp, dwp, dbp, rows, cols,
               rows_per_block, dropout);
      else
        launch(add_layer_norm_backward_kernel<T, 1>, blocks, threads, kSharedBytes, gp, gsp, sp,
               ptr<float>(mean), ptr<float>(rstd), wp, dsp, dxp, dwp, dbp, rows, cols,
               rows_per_block, dropout);
    }
    if (in.weight.defined()) dweight = sum_partials<T>(dw_part, summed.scalar_type());
    if (has_bias) dbias = sum_partials<T>(db_part, summed.scalar_type());
  });
  return {in.dsummed, in.dx, dweight, dbias};
}

}  // namespace fusedlm::cuda
