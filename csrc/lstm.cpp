// lstm_cell on the CPU: the pointwise part of an LSTM step, split over rows of the batch.
#include "checks.h"
#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// gates as [rows, 4 * cell] and c_prev as [rows, cell], contiguous, of one dtype.
struct LstmRows {
  at::Tensor gates, c_prev;
  int64_t rows, cell;
};

LstmRows lstm_rows(const at::Tensor& gates, const at::Tensor& c_prev) {
  check_cpu(gates, "gates");
  check_cpu(c_prev, "c_prev");
  TORCH_CHECK_TYPE(gates.scalar_type() == c_prev.scalar_type(), "gates and c_prev must share a dtype");
  LstmRows in{as_rows(gates), as_rows(c_prev), 0, 0};
  in.rows = in.c_prev.size(0);
  in.cell = in.c_prev.size(1);
  TORCH_CHECK_VALUE(in.gates.size(0) == in.rows && in.gates.size(1) == 4 * in.cell,
                    "gates must have shape [rows, 4 * cell] for c_prev [rows, cell]");
  return in;
}

// A gradient of h or c: c_prev's shape, as contiguous rows of c_prev's dtype.
at::Tensor grad_rows(const at::Tensor& grad, const at::Tensor& c_prev, const char* name) {
  check_cpu(grad, name);
  TORCH_CHECK_VALUE(grad.sizes() == c_prev.sizes(), name, " must have c_prev's shape");
  return as_rows(grad.to(c_prev.scalar_type()));
}

// Row `row` of t seen as rows of `width` elements.
char* row_at(const at::Tensor& t, int64_t row, int64_t width) {
  return static_cast<char*>(t.data_ptr()) + row * width * t.element_size();
}

// Calls f(begin, end) over the rows in tasks of near 64 KiB of gate pre-activations.
template <typename F>
void for_rows(const LstmRows& in, F&& f) {
  at::parallel_for(0, in.rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(in.cell, 1)), f);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lstm_cell_forward(const at::Tensor& gates,
                                                     const at::Tensor& c_prev, double cell_clip) {
  const auto in = lstm_rows(gates, c_prev);
  const auto dtype = kernel_dtype(c_prev);
  // Outputs in c_prev's shape, contiguous (the kernels write them as rows): an op's output
  // must not be a view.
  auto h = at::empty(c_prev.sizes(), in.c_prev.options());
  auto c = at::empty(c_prev.sizes(), in.c_prev.options());
  const int64_t cell = in.cell;
  for_rows(in, [&](int64_t begin, int64_t end) {
    cpu_kernels().lstm_cell_forward(dtype, row_at(in.gates, begin, 4 * cell),
                                    row_at(in.c_prev, begin, cell), row_at(h, begin, cell),
                                    row_at(c, begin, cell), end - begin, cell, cell_clip);
  });
  return {h, c};
}

std::tuple<at::Tensor, at::Tensor> lstm_cell_backward(const at::Tensor& grad_h,
                                                      const at::Tensor& grad_c,
                                                      const at::Tensor& gates,
                                                      const at::Tensor& c_prev, double cell_clip) {
  const auto in = lstm_rows(gates, c_prev);
  const auto dtype = kernel_dtype(c_prev);
  const auto dh = grad_rows(grad_h, c_prev, "grad_h"), dc = grad_rows(grad_c, c_prev, "grad_c");
  auto dgates = at::empty(gates.sizes(), in.gates.options());
  auto dc_prev = at::empty(c_prev.sizes(), in.c_prev.options());
  const int64_t cell = in.cell;
  for_rows(in, [&](int64_t begin, int64_t end) {
    cpu_kernels().lstm_cell_backward(dtype, row_at(dh, begin, cell), row_at(dc, begin, cell),
                                     row_at(in.gates, begin, 4 * cell),
                                     row_at(in.c_prev, begin, cell), row_at(dgates, begin, 4 * cell),
                                     row_at(dc_prev, begin, cell), end - begin, cell, cell_clip);
  });
  return {dgates, dc_prev};
}

}  // namespace fusedlm
