// add_layer_norm on the CPU: (dropout(x) + residual) and its LayerNorm in one
// pass over memory, and the backward in one more, split over row blocks.
#include <vector>

#include "checks.h"
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

// Calls f(blk, begin, end, keep) for each block blk of rows [begin, end), keep being its
// dropout mask (null without dropout). Tasks cover whole blocks, so a block's row of
// partial sums has exactly one writer.
template <typename F>
void for_blocks(int64_t rows, int64_t cols, uint64_t seed, double p, F&& f) {
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<uint8_t> keep;
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kBlockRows, end = std::min(rows, begin + kBlockRows);
      f(blk, begin, end, keep_rows(keep, seed, begin, end, cols, p));
    }
  });
}

const char* bytes(const at::Tensor& t) { return static_cast<const char*>(t.data_ptr()); }
char* bytes_mut(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed) {
  const auto in = add_layer_norm_inputs(x, residual, weight, bias, check_cpu);
  const auto dtype = kernel_dtype(x);
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;

  const int64_t rows = in.x.size(0), cols = in.x.size(1);
  // Outputs in x's shape, contiguous, so they are written as [rows, cols] and returned as
  // they are: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options()), summed = at::empty(x.sizes(), in.x.options());
  auto stats = in.x.options().dtype(acc_dtype(x.scalar_type()));
  auto mean = at::empty({rows}, stats), rstd = at::empty({rows}, stats);

  const size_t row_bytes = cols * in.x.element_size(), stat_bytes = mean.element_size();
  const char *xp = bytes(in.x), *rp = in.residual.defined() ? bytes(in.residual) : nullptr;
  char *op = bytes_mut(out), *sp = bytes_mut(summed), *mp = bytes_mut(mean), *vp = bytes_mut(rstd);
  const void *wp = in.weight.defined() ? in.weight.data_ptr() : nullptr;
  const void *bp = in.bias.defined() ? in.bias.data_ptr() : nullptr;
  for_blocks(rows, cols, s, dropout_p, [&](int64_t, int64_t begin, int64_t end,
                                           const uint8_t* keep) {
    const size_t at = begin * row_bytes;
    cpu_kernels().add_layer_norm_forward(dtype, xp + at, rp ? rp + at : nullptr, wp, bp, op + at,
                                         sp + at, mp + begin * stat_bytes, vp + begin * stat_bytes,
                                         end - begin, cols, eps, keep, dropout_p);
  });
  return {out, summed, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed) {
  const auto acc = acc_dtype(summed.scalar_type());
  const bool dropout = dropout_p > 0;
  const auto in = add_layer_norm_grad_inputs(grad_out, grad_summed, summed, mean, rstd, weight,
                                             acc, dropout, has_residual, check_cpu);
  const auto dtype = kernel_dtype(summed);
  const uint64_t s = dropout ? seed_value(seed) : 0;

  const int64_t rows = in.summed.size(0), cols = in.summed.size(1);
  const auto options = in.summed.options();
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  const bool has_weight = in.weight.defined();
  auto partial_options = options.dtype(acc);
  auto dw_part = at::empty({has_weight ? blocks : 0, cols}, partial_options);
  auto db_part = at::empty({has_bias ? blocks : 0, cols}, partial_options);

  const size_t row_bytes = cols * in.summed.element_size(), stat_bytes = mean.element_size();
  const size_t part_bytes = cols * dw_part.element_size();
  const char *gp = bytes(in.grad_out), *sp = bytes(in.summed);
  const char* gsp = in.grad_summed.defined() ? bytes(in.grad_summed) : nullptr;
  const char *mp = bytes(mean), *vp = bytes(rstd);
  char* dsp = in.dsummed.defined() ? bytes_mut(in.dsummed) : nullptr;
  char* dxp = in.dx.defined() ? bytes_mut(in.dx) : nullptr;
  char* dwp = has_weight ? bytes_mut(dw_part) : nullptr;
  char* dbp = has_bias ? bytes_mut(db_part) : nullptr;
  const void* wp = has_weight ? in.weight.data_ptr() : nullptr;
  for_blocks(rows, cols, s, dropout_p, [&](int64_t blk, int64_t begin, int64_t end,
                                           const uint8_t* keep) {
    const size_t at = begin * row_bytes;
    cpu_kernels().add_layer_norm_backward(
        dtype, gp + at, gsp ? gsp + at : nullptr, sp + at, mp + begin * stat_bytes,
        vp + begin * stat_bytes, wp, dsp ? dsp + at : nullptr, dxp ? dxp + at : nullptr,
        dwp ? dwp + blk * part_bytes : nullptr, dbp ? dbp + blk * part_bytes : nullptr,
        end - begin, cols, keep, dropout_p);
  });
  return {in.dsummed, in.dx,
          has_weight ? sum_partials(dw_part, summed.scalar_type()) : at::Tensor(),
          has_bias ? sum_partials(db_part, summed.scalar_type()) : at::Tensor()};
}

}  // namespace fusedlm
