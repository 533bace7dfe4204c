// bias_gelu and gelu_ffn on the CPU: ATen's matrix products, with the bias,
// GELU, dropout and their backward fused into one pass between them.
#include <vector>

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

// out = dropout(gelu(pre + bias)) over the rows of a 2-d contiguous tensor.
void gelu_rows(const at::Tensor& pre, const std::optional<at::Tensor>& bias, at::Tensor& out,
               cpu::Gelu kind, double p, uint64_t seed) {
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

// d(pre) from d(out) for gelu_rows; returns the bias gradient (undefined without bias).
at::Tensor gelu_rows_backward(const at::Tensor& grad, const at::Tensor& pre,
                              const std::optional<at::Tensor>& bias, at::Tensor& dpre,
                              cpu::Gelu kind, double p, uint64_t seed) {
  const int64_t rows = pre.size(0), cols = pre.size(1);
  const bool has_bias = data_or_null(bias) != nullptr;
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
  return has_bias ? sum_partials(partial, bias->scalar_type()) : at::Tensor();
}

at::Tensor as_rows(const at::Tensor& t) { return t.contiguous().view({-1, t.size(-1)}); }

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  check_cpu(x, "x");
  auto x2 = as_rows(x);
  auto out = at::empty_like(x2);
  gelu_rows(x2, bias ? std::optional<at::Tensor>(bias->contiguous()) : bias, out,
            gelu_kind(approximate), 0.0, 0);
  return out.view(x.sizes());
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate) {
  check_cpu(x, "x");
  auto x2 = as_rows(x);
  auto g2 = as_rows(grad);
  auto dx = at::empty_like(x2);
  auto db = gelu_rows_backward(g2, x2, bias ? std::optional<at::Tensor>(bias->contiguous()) : bias,
                               dx, gelu_kind(approximate), 0.0, 0);
  return {dx.view(x.sizes()), db};
}

std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed) {
  check_cpu(x, "x");
  const auto kind = gelu_kind(approximate);
  auto x2 = as_rows(x);
  auto pre = at::mm(x2, w1.t());
  auto act = at::empty_like(pre);
  gelu_rows(pre, b1, act, kind, dropout_p, dropout_p > 0 ? seed_value(seed) : 0);
  auto y = b2 ? at::addmm(*b2, act, w2.t()) : at::mm(act, w2.t());
  auto out_shape = x.sizes().vec();
  out_shape.back() = w2.size(0);
  return {y.view(out_shape), pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed) {
  const auto kind = gelu_kind(approximate);
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;
  auto x2 = as_rows(x);
  auto g2 = as_rows(grad);
  // The activation is recomputed from the saved pre-activation rather than stored.
  auto act = at::empty_like(pre_activation);
  gelu_rows(pre_activation, b1, act, kind, dropout_p, s);
  auto dw2 = at::mm(g2.t(), act);
  auto db2 = b2 ? g2.sum(0, false, acc_dtype(g2.scalar_type())).to(b2->scalar_type()) : at::Tensor();
  auto dact = at::mm(g2, w2);
  auto dpre = at::empty_like(pre_activation);
  auto db1 = gelu_rows_backward(dact, pre_activation, b1, dpre, kind, dropout_p, s);
  auto dx = at::mm(dpre, w1).view(x.sizes());
  auto dw1 = at::mm(dpre.t(), x2);
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace fusedlm
