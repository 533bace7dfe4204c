// bias_gelu and gelu_ffn on the CPU: ATen's matrix products, with the bias,
// GELU, dropout and their backward fused into one pass between them.
#include <vector>

#include "checks.h"
#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// Rows of a [rows, cols] tensor each task takes; keeps tasks near 64 KiB of input.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// The keep mask for rows [begin, end) of a [rows, cols] dropout stream.
const uint8_t* keep_rows(std::vector<uint8_t>& buffer, uint64_t seed, int64_t begin, int64_t end,
                         int64_t cols, double p) {
  if (p <= 0.0) return nullptr;
  buffer.resize((end - begin) * cols);
  cpu_kernels().dropout_mask(seed, static_cast<uint64_t>(begin * cols), (end - begin) * cols,
                             p, buffer.data());
  return buffer.data();
}

cpu::Gelu gelu_kind(bool tanh) { return tanh ? cpu::Gelu::kTanh : cpu::Gelu::kErf; }

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// out = dropout(gelu(pre + bias)) over the rows of a 2-d contiguous tensor, into out's
// contiguous memory (of any shape); bias is undefined or [cols].
void gelu_rows(const at::Tensor& pre, const at::Tensor& bias, at::Tensor& out, cpu::Gelu kind,
               double p, uint64_t seed) {
  const int64_t rows = pre.size(0), cols = pre.size(1);
  const auto dtype = kernel_dtype(pre);
  const size_t elem = pre.element_size();
  const char* src = static_cast<const char*>(pre.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const void* b = data_or_null(bias);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> keep;
    cpu_kernels().bias_gelu_forward(dtype, src + begin * cols * elem, b,
                                    dst + begin * cols * elem, end - begin, cols, kind,
                                    keep_rows(keep, seed, begin, end, cols, p),
                                    p);
  });
}

// d(pre) from d(out) for gelu_rows, into dpre's contiguous memory; returns the bias
// gradient (undefined without bias).
at::Tensor gelu_rows_backward(const at::Tensor& grad, const at::Tensor& pre, const at::Tensor& bias,
                              at::Tensor& dpre, cpu::Gelu kind, double p, uint64_t seed) {
  const int64_t rows = pre.size(0), cols = pre.size(1);
  const bool has_bias = bias.defined();
  const int64_t blocks = (rows + kReduceBlockRows - 1) / kReduceBlockRows;
  auto partial = at::empty({has_bias ? blocks : 0, cols},
                           pre.options().dtype(acc_dtype(pre.scalar_type())));
  const auto dtype = kernel_dtype(pre);
  const size_t elem = pre.element_size();
  const char* g = static_cast<const char*>(grad.data_ptr());
  const char* x = static_cast<const char*>(pre.data_ptr());
  char* dx = static_cast<char*>(dpre.data_ptr());
  char* part = has_bias ? static_cast<char*>(partial.data_ptr()) : nullptr;
  const size_t part_row = cols * partial.element_size();
  const void* b = data_or_null(bias);
  // Tasks cover whole reduction blocks, so each partial sum has exactly one writer.
  const int64_t grain = std::max<int64_t>(1, grain_rows(cols) / kReduceBlockRows);
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> keep;
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kReduceBlockRows, end = std::min(rows, begin + kReduceBlockRows);
      const int64_t at = begin * cols * elem;
      cpu_kernels().bias_gelu_backward(dtype, g + at, x + at, b, dx + at,
                                       part ? part + blk * part_row : nullptr, end - begin, cols,
                                       kind, keep_rows(keep, seed, begin, end, cols, p),
                                       p);
    }
  });
  return has_bias ? sum_partials(partial, bias.scalar_type()) : at::Tensor();
}

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  const auto in = bias_gelu_inputs(x, bias, approximate, check_cpu);
  // Outputs are allocated in their final shapes: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options());
  gelu_rows(in.x, in.bias, out, gelu_kind(in.tanh), 0.0, 0);
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate) {
  const auto in = bias_gelu_grad_inputs(grad, x, bias, approximate, check_cpu);
  auto dx = at::empty(x.sizes(), in.x.options());
  auto db = gelu_rows_backward(in.grad, in.x, in.bias, dx, gelu_kind(in.tanh), 0.0, 0);
  return {dx, db};
}

std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed) {
  const auto in = gelu_ffn_inputs(x, w1, b1, w2, b2, approximate, check_cpu);
  auto pre = at::mm(in.x, in.w1.t());
  auto act = at::empty_like(pre);
  gelu_rows(pre, in.b1, act, gelu_kind(in.tanh), dropout_p, dropout_p > 0 ? seed_value(seed) : 0);
  return {ffn_output(x, act, in.w2, in.b2), pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed) {
  const auto in = gelu_ffn_grad_inputs(grad, x, pre_activation, w1, b1, w2, b2, approximate,
                                       check_cpu);
  const auto kind = gelu_kind(in.tanh);
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;
  const auto& g2 = in.grad;
  // The activation is recomputed from the saved pre-activation rather than stored.
  auto act = at::empty_like(in.pre_activation);
  gelu_rows(in.pre_activation, in.b1, act, kind, dropout_p, s);
  auto dpre = at::empty_like(in.pre_activation);
  auto db1 = gelu_rows_backward(at::mm(g2, in.w2), in.pre_activation, in.b1, dpre, kind, dropout_p, s);
  const auto g = ffn_backward_products(in, x, g2, act, dpre);
  return {g.dx, g.dw1, db1, g.dw2, g.db2};
}

}  // namespace fusedlm
