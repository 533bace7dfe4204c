// lstm_cell on the CPU: the pointwise part of an LSTM step, split over rows of the batch.
#include "checks.h"
#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// Rows each task takes: near 64 KiB of gate pre-activations per task.
int64_t grain_rows(int64_t cell) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(cell, 1)); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> lstm_cell_forward(const at::Tensor& gates,
                                                     const at::Tensor& c_prev, double cell_clip) {
  check_cpu(gates, "gates");
  check_cpu(c_prev, "c_prev");
  auto g2 = as_rows(gates);
  auto c2 = as_rows(c_prev);
  const int64_t rows = c2.size(0), cell = c2.size(1);
  TORCH_CHECK_VALUE(g2.size(0) == rows && g2.size(1) == 4 * cell,
                    "gates must have shape [rows, 4 * cell] for c_prev [rows, cell]");
  TORCH_CHECK_TYPE(gates.scalar_type() == c_prev.scalar_type(), "gates and c_prev must share a dtype");
  // Outputs in c_prev's shape, contiguous (the kernels write them as rows): an op's output
  // must not be a view.
  auto h = at::empty(c_prev.sizes(), c2.options());
  auto c = at::empty(c_prev.sizes(), c2.options());
  const auto dtype = kernel_dtype(c2);
  const size_t elem = c2.element_size();
  const char* g = static_cast<const char*>(g2.data_ptr());
  const char* cp = static_cast<const char*>(c2.data_ptr());
  char* hp = static_cast<char*>(h.data_ptr());
  char* cn = static_cast<char*>(c.data_ptr());
  at::parallel_for(0, rows, grain_rows(cell), [&](int64_t begin, int64_t end) {
    const int64_t at = begin * cell * elem;
    cpu_kernels().lstm_cell_forward(dtype, g + 4 * at, cp + at, hp + at, cn + at, end - begin,
                                    cell, cell_clip);
  });
  return {h, c};
}

std::tuple<at::Tensor, at::Tensor> lstm_cell_backward(const at::Tensor& grad_h,
                                                      const at::Tensor& grad_c,
                                                      const at::Tensor& gates,
                                                      const at::Tensor& c_prev, double cell_clip) {
  check_cpu(gates, "gates");
  auto g2 = as_rows(gates);
  auto c2 = as_rows(c_prev);
  auto dh = as_rows(grad_h.to(c_prev.scalar_type()));
  auto dc = as_rows(grad_c.to(c_prev.scalar_type()));
  const int64_t rows = c2.size(0), cell = c2.size(1);
  auto dgates = at::empty(gates.sizes(), g2.options());
  auto dc_prev = at::empty(c_prev.sizes(), c2.options());
  const auto dtype = kernel_dtype(c2);
  const size_t elem = c2.element_size();
  const char* g = static_cast<const char*>(g2.data_ptr());
  const char* cp = static_cast<const char*>(c2.data_ptr());
  const char* dhp = static_cast<const char*>(dh.data_ptr());
  const char* dcp = static_cast<const char*>(dc.data_ptr());
  char* dg = static_cast<char*>(dgates.data_ptr());
  char* dcprev = static_cast<char*>(dc_prev.data_ptr());
  at::parallel_for(0, rows, grain_rows(cell), [&](int64_t begin, int64_t end) {
    const int64_t at = begin * cell * elem;
    cpu_kernels().lstm_cell_backward(dtype, dhp + at, dcp + at, g + 4 * at, cp + at,
                                     dg + 4 * at, dcprev + at, end - begin, cell, cell_clip);
  });
  return {dgates, dc_prev};
}

}  // namespace fusedlm
