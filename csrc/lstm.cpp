// lstm_cell on the CPU: the pointwise part of an LSTM step, split over rows of the batch.
#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// Rows each task takes: near 64 KiB of gate pre-activations per task.
int64_t grain_rows(int64_t cell) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(cell, 1)); }

at::Tensor as_rows(const at::Tensor& t) { return t.contiguous().view({-1, t.size(-1)}); }

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
  auto h = at::empty_like(c2);
  auto c = at::empty_like(c2);
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
  return {h.view(c_prev.sizes()), c.view(c_prev.sizes())};
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
  auto dgates = at::empty_like(g2);
  auto dc_prev = at::empty_like(c2);
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
  return {dgates.view(gates.sizes()), dc_prev.view(c_prev.sizes())};
}

}  // namespace fusedlm
