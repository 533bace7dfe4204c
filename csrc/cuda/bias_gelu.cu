// bias_gelu on CUDA, the host side: checks, launch shapes and launches of the kernels in
// kernels/cuda/bias_gelu.cuh (which describes them).
#include "bias_gelu.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "ops.h"

namespace fusedlm::cuda {
namespace {

using namespace kernels::bias_gelu;

// The launch of both kernels: (row tiles, column blocks) of kThreads vectors each.
Grid tiles(int64_t rows, int64_t cols, int n) {
  return Grid(ceil_div(rows, kTileRows), ceil_div(ceil_div(cols, n), kThreads));
}

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  const auto in = bias_gelu_inputs(x, bias, approximate, check_device_tensor);
  const DeviceGuard guard(x);
  // Outputs are allocated in their final shapes: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options());
  const int64_t rows = in.x.size(0), cols = in.x.size(1);
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (in.x.numel() == 0) return;
    constexpr int V = kVec<T>;
    const T *xp = ptr<T>(in.x), *bp = ptr<T>(in.bias);
    T* op = ptr<T>(out);
    const bool vector = cols % V == 0 && all_aligned16(xp, bp, op);
    const Grid grid = tiles(rows, cols, vector ? V : 1);
    if (vector && in.tanh)
      launch(bias_gelu_forward_kernel<T, V, true>, grid, kThreads, 0, xp, bp, op, rows, cols);
    else if (vector)
      launch(bias_gelu_forward_kernel<T, V, false>, grid, kThreads, 0, xp, bp, op, rows, cols);
    else if (in.tanh)
      launch(bias_gelu_forward_kernel<T, 1, true>, grid, kThreads, 0, xp, bp, op, rows, cols);
    else
      launch(bias_gelu_forward_kernel<T, 1, false>, grid, kThreads, 0, xp, bp, op, rows, cols);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate) {
  const auto in = bias_gelu_grad_inputs(grad, x, bias, approximate, check_device_tensor);
  const DeviceGuard guard(x);
  auto dx = at::empty(x.sizes(), in.x.options());
  const int64_t rows = in.x.size(0), cols = in.x.size(1);
  at::Tensor dbias;
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T *gp = ptr<T>(in.grad), *xp = ptr<T>(in.x), *bp = ptr<T>(in.bias);
    T* dxp = ptr<T>(dx);
    const bool vector = cols % V == 0 && all_aligned16(gp, xp, bp, dxp);
    const Grid grid = tiles(rows, cols, vector ? V : 1);
    auto db_part = at::empty({in.bias.defined() ? int64_t(grid.x) : 0, cols},
                             in.x.options().dtype(at::kFloat));
    float* dbp = in.bias.defined() ? ptr<float>(db_part) : nullptr;
    if (in.x.numel() > 0) {
      if (vector && in.tanh)
        launch(bias_gelu_backward_kernel<T, V, true>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
      else if (vector)
        launch(bias_gelu_backward_kernel<T, V, false>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
      else if (in.tanh)
        launch(bias_gelu_backward_kernel<T, 1, true>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
      else
        launch(bias_gelu_backward_kernel<T, 1, false>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
    }
    if (in.bias.defined()) dbias = sum_partials<T>(db_part, x.scalar_type());
  });
  return {dx, dbias};
}

}  // namespace fusedlm::cuda
