// add_layer_norm on the CPU: (dropout(x) + residual) and its LayerNorm in one
// pass over memory, and the backward in one more, split over row blocks.
#include <vector>

#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// Rows per kernel call. A block's keep mask (64 x 768 bytes at BERT-base) is
// drawn just before the kernel reads it, so it is still in cache; in the
// backward each block also owns one row of partial sums.
constexpr int64_t kBlockRows = kReduceBlockRows;

// The keep mask for rows [begin, end) of a [rows, cols] dropout stream, or null without dropout.
const uint8_t* keep_rows(std::vector<uint8_t>& buffer, uint64_t seed, int64_t begin, int64_t end,
                         int64_t cols, double p) {
  if (p <= 0.0) return nullptr;
  buffer.resize((end - begin) * cols);
  cpu_kernels().dropout_mask(seed, static_cast<uint64_t>(begin * cols), (end - begin) * cols, p,
                             buffer.data());
  return buffer.data();
}

// Blocks per task: about 64 KiB of each input, and whole blocks.
int64_t grain_blocks(int64_t cols) {
  return std::max<int64_t>(1, 16384 / (std::max<int64_t>(cols, 1) * kBlockRows));
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name, const char* other) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", other, " ",
                    like.sizes(), ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ", other,
                   " (", like.scalar_type(), "), got ", t.scalar_type());
}

// A contiguous [hidden] parameter checked against x, or nullopt.
std::optional<at::Tensor> param(const std::optional<at::Tensor>& t, const at::Tensor& x,
                                const char* name) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  check_cpu(*t, name);
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == x.size(-1), name, " must have shape [",
                    x.size(-1), "], got ", t->sizes());
  TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(), name, " must have the dtype of x (",
                   x.scalar_type(), "), got ", t->scalar_type());
  return t->contiguous();
}

at::Tensor as_rows(const at::Tensor& t) { return t.contiguous().view({-1, t.size(-1)}); }

const char* bytes(const at::Tensor& t) { return static_cast<const char*>(t.data_ptr()); }
char* bytes_mut(at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed) {
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dimension");
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) check_like(*residual, x, "residual", "x");
  const auto w = param(weight, x, "weight"), b = param(bias, x, "bias");
  const auto dtype = kernel_dtype(x);
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;

  auto x2 = as_rows(x);
  auto r2 = has_residual ? as_rows(*residual) : at::Tensor();
  const int64_t rows = x2.size(0), cols = x2.size(1);
  auto out = at::empty_like(x2), summed = at::empty_like(x2);
  auto stats = x2.options().dtype(acc_dtype(x.scalar_type()));
  auto mean = at::empty({rows}, stats), rstd = at::empty({rows}, stats);

  const size_t row_bytes = cols * x2.element_size(), stat_bytes = mean.element_size();
  const char *xp = bytes(x2), *rp = has_residual ? bytes(r2) : nullptr;
  char *op = bytes_mut(out), *sp = bytes_mut(summed), *mp = bytes_mut(mean), *vp = bytes_mut(rstd);
  const void *wp = w ? w->data_ptr() : nullptr, *bp = b ? b->data_ptr() : nullptr;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<uint8_t> keep;
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kBlockRows, end = std::min(rows, begin + kBlockRows);
      const size_t at = begin * row_bytes;
      cpu_kernels().add_layer_norm_forward(
          dtype, xp + at, rp ? rp + at : nullptr, wp, bp, op + at, sp + at,
          mp + begin * stat_bytes, vp + begin * stat_bytes, end - begin, cols, eps,
          keep_rows(keep, s, begin, end, cols, dropout_p), dropout_p);
    }
  });
  return {out.view(x.sizes()), summed.view(x.sizes()), mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed) {
  check_cpu(summed, "summed");
  TORCH_CHECK_VALUE(summed.dim() >= 1 && summed.size(-1) > 0,
                    "summed must have a non-empty last dimension");
  check_like(grad_out, summed, "grad_out", "summed");
  const bool has_grad_summed = grad_summed.has_value() && grad_summed->defined();
  if (has_grad_summed) check_like(*grad_summed, summed, "grad_summed", "summed");
  const auto w = param(weight, summed, "weight");
  const auto dtype = kernel_dtype(summed);
  const auto acc = acc_dtype(summed.scalar_type());
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;

  auto s2 = as_rows(summed);
  const int64_t rows = s2.size(0), cols = s2.size(1);
  for (auto [t, name] : {std::pair{&mean, "mean"}, std::pair{&rstd, "rstd"}})
    TORCH_CHECK_VALUE(t->numel() == rows && t->scalar_type() == acc && t->is_contiguous(), name,
                      " must be a contiguous [", rows, "] ", acc, " tensor");
  auto g2 = as_rows(grad_out);
  auto gs2 = has_grad_summed ? as_rows(*grad_summed) : at::Tensor();
  // Without dropout dx is dsummed itself (the caller hands one tensor to both
  // x and residual); with it, dsummed is written only for a residual.
  const bool dropout = dropout_p > 0;
  auto dsummed = !dropout || has_residual ? at::empty_like(s2) : at::Tensor();
  auto dx = dropout ? at::empty_like(s2) : at::Tensor();
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  auto partial_options = s2.options().dtype(acc);
  auto dw_part = at::empty({w ? blocks : 0, cols}, partial_options);
  auto db_part = at::empty({has_bias ? blocks : 0, cols}, partial_options);

  const size_t row_bytes = cols * s2.element_size(), stat_bytes = mean.element_size();
  const size_t part_bytes = cols * dw_part.element_size();
  const char *gp = bytes(g2), *gsp = has_grad_summed ? bytes(gs2) : nullptr, *sp = bytes(s2);
  const char *mp = bytes(mean), *vp = bytes(rstd);
  char* dsp = dsummed.defined() ? bytes_mut(dsummed) : nullptr;
  char* dxp = dx.defined() ? bytes_mut(dx) : nullptr;
  char* dwp = w ? bytes_mut(dw_part) : nullptr;
  char* dbp = has_bias ? bytes_mut(db_part) : nullptr;
  const void* wp = w ? w->data_ptr() : nullptr;
  // Tasks cover whole blocks, so each row of partial sums has exactly one writer.
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<uint8_t> keep;
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kBlockRows, end = std::min(rows, begin + kBlockRows);
      const size_t at = begin * row_bytes;
      cpu_kernels().add_layer_norm_backward(
          dtype, gp + at, gsp ? gsp + at : nullptr, sp + at, mp + begin * stat_bytes,
          vp + begin * stat_bytes, wp, dsp ? dsp + at : nullptr, dxp ? dxp + at : nullptr,
          dwp ? dwp + blk * part_bytes : nullptr, dbp ? dbp + blk * part_bytes : nullptr,
          end - begin, cols, keep_rows(keep, s, begin, end, cols, dropout_p), dropout_p);
    }
  });
  auto shaped = [&](const at::Tensor& t) { return t.defined() ? t.view(summed.sizes()) : t; };
  return {shaped(dsummed), shaped(dx),
          w ? sum_partials(dw_part, summed.scalar_type()) : at::Tensor(),
          has_bias ? sum_partials(db_part, summed.scalar_type()) : at::Tensor()};
}

}  // namespace fusedlm
