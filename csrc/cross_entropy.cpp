// cross_entropy, distillation_loss and masked_lm_loss on the CPU.
//
// cross_entropy: one pass of the fused kernel gives the per-row losses and, in a new
// buffer, d(loss)/d(logits), already divided by the number of labelled rows for
// "mean". The backward only scales that buffer by grad_output.
//
// masked_lm_loss: the loop of csrc/masked_lm.cpp, with the fused kernel for each chunk
// (which also sums the gradient's columns, the bias gradient).
#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "common.h"
#include "masked_lm.h"
#include "ops.h"

namespace fusedlm {
namespace {

// Rows of a [rows, cols] tensor each task takes; keeps tasks near 64 KiB of input.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// How many labels are not ignore_index. Every other label must be a class index: the
// kernel reads logits[label] unchecked.
int64_t count_labelled(const at::Tensor& labels1, int64_t classes, int64_t ignore_index) {
  const int64_t* y = labels1.data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < labels1.numel(); ++i) {
    if (y[i] == ignore_index) continue;
    TORCH_CHECK_VALUE(0 <= y[i] && y[i] < classes, "labels: ", y[i], " at flat position ", i,
                      " is no class index in [0, ", classes, ") nor ignore_index");
    ++count;
  }
  return count;
}

// The fused kernel over logits2 [rows, classes] (contiguous). loss (rows elements,
// contiguous) receives the losses; grad is undefined (loss only) or the contiguous memory of
// rows * classes elements, possibly logits2 itself; col_partial, when defined, is [ceil(rows / kReduceBlockRows), classes] and
// receives the column sums of grad per block of rows; row_scale is undefined or [rows].
// loss, col_partial and row_scale are in the accumulation dtype.
void run_kernel(const at::Tensor& logits2, const at::Tensor& labels1, const at::Tensor& loss,
                const at::Tensor& grad, const at::Tensor& col_partial, int64_t ignore_index,
                double label_smoothing, double grad_scale, const at::Tensor& row_scale) {
  const int64_t rows = logits2.size(0), classes = logits2.size(1);
  const auto dtype = kernel_dtype(logits2);
  const size_t elem = logits2.element_size(), acc = loss.element_size();
  const char* x = static_cast<const char*>(logits2.data_ptr());
  const int64_t* y = labels1.data_ptr<int64_t>();
  char* l = static_cast<char*>(loss.data_ptr());
  char* g = grad.defined() ? static_cast<char*>(grad.data_ptr()) : nullptr;
  char* part = col_partial.defined() ? static_cast<char*>(col_partial.data_ptr()) : nullptr;
  const char* rs = row_scale.defined() ? static_cast<const char*>(row_scale.data_ptr()) : nullptr;
  auto run = [&](int64_t begin, int64_t end, void* col_sum) {
    const int64_t at = begin * classes * elem;
    cpu_kernels().cross_entropy_forward(dtype, x + at, y + begin, l + begin * acc,
                                        g ? g + at : nullptr, col_sum, end - begin, classes,
                                        ignore_index, label_smoothing, grad_scale,
                                        rs ? rs + begin * acc : nullptr);
  };
  if (!part) {
    at::parallel_for(0, rows, grain_rows(classes), [&](int64_t begin, int64_t end) {
      run(begin, end, nullptr);
    });
    return;
  }
  // Tasks cover whole reduction blocks, so each partial sum has exactly one writer.
  const int64_t blocks = (rows + kReduceBlockRows - 1) / kReduceBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kReduceBlockRows;
      run(begin, std::min(rows, begin + kReduceBlockRows), part + blk * classes * acc);
    }
  });
}

// The sum of the losses (contiguous, accumulation dtype) as a float64 scalar tensor,
// summed in row order, so that it does not depend on the thread count.
at::Tensor total(const at::Tensor& losses) {
  double sum = 0.0;
  AT_DISPATCH_FLOATING_TYPES(losses.scalar_type(), "total", [&] {
    const scalar_t* l = losses.data_ptr<scalar_t>();
    for (int64_t i = 0; i < losses.numel(); ++i) sum += l[i];
  });
  return at::scalar_tensor(sum, losses.options().dtype(at::kDouble));
}

// The loss a reduction returns from the per-row losses.
at::Tensor reduce_losses(const at::Tensor& losses, Reduction reduction, int64_t labelled) {
  if (reduction == Reduction::kNone) return losses;
  auto sum = total(losses);
  if (reduction == Reduction::kMean) sum = sum / double(std::max<int64_t>(labelled, 1));
  return sum.to(losses.scalar_type());
}

// src * scale in src's dtype, rounded once. scale (accumulation dtype) holds one value,
// or one per row of src viewed as [scale.numel(), -1].
at::Tensor scaled(const at::Tensor& src, const at::Tensor& scale) {
  if (!src.defined()) return src;
  auto in = src.contiguous();
  auto out = at::empty_like(in);
  const auto dtype = kernel_dtype(in);
  const size_t elem = in.element_size(), acc = scale.element_size();
  const char* s = static_cast<const char*>(scale.data_ptr());
  const char* x = static_cast<const char*>(in.data_ptr());
  char* y = static_cast<char*>(out.data_ptr());
  if (scale.numel() == 1) {
    at::parallel_for(0, in.numel(), 32768, [&](int64_t begin, int64_t end) {
      cpu_kernels().cross_entropy_scale_grad(dtype, x + begin * elem, y + begin * elem, 1,
                                             end - begin, s, 0);
    });
    return out;
  }
  const int64_t rows = scale.numel(), cols = in.numel() / std::max<int64_t>(rows, 1);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    cpu_kernels().cross_entropy_scale_grad(dtype, x + begin * cols * elem, y + begin * cols * elem,
                                           end - begin, cols, s + begin * acc, 1);
  });
  return out;
}

at::Tensor labelled_positions(const at::Tensor& labels1, int64_t classes, int64_t ignore_index) {
  count_labelled(labels1, classes, ignore_index);
  return at::nonzero(labels1 != ignore_index).view(-1);
}

// The fused kernel on one chunk of masked_lm_loss, summing its gradient's columns per
// block of rows, then over the blocks.
at::Tensor chunk_cross_entropy(const at::Tensor& logits, const at::Tensor& labels1,
                               const at::Tensor& losses, bool with_grad, bool col_sum,
                               int64_t ignore_index, double label_smoothing, double grad_scale,
                               const at::Tensor& row_scale) {
  const auto acc = losses.scalar_type();
  const int64_t blocks = (logits.size(0) + kReduceBlockRows - 1) / kReduceBlockRows;
  auto partial = col_sum ? at::empty({blocks, logits.size(1)}, losses.options()) : at::Tensor();
  run_kernel(logits, labels1, losses, with_grad ? logits : at::Tensor(), partial, ignore_index,
             label_smoothing, grad_scale, row_scale);
  return col_sum ? sum_partials(partial, acc) : at::Tensor();
}

const MlmBackend kCpuMlm{check_cpu, labelled_positions, chunk_cross_entropy, total, scaled};

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad) {
  const auto in = cross_entropy_inputs(logits, labels, reduction, check_cpu);
  kernel_dtype(logits);
  const int64_t labelled = count_labelled(in.labels, in.logits.size(1), ignore_index);
  // Outputs in their final shapes, contiguous (the kernel writes them as rows): an op's
  // output must not be a view.
  auto losses = at::empty(labels.sizes(), in.logits.options().dtype(acc_dtype(logits.scalar_type())));
  auto grad = with_grad ? at::empty(logits.sizes(), in.logits.options()) : at::Tensor();
  const double grad_scale =
      in.reduction == Reduction::kMean ? 1.0 / std::max<int64_t>(labelled, 1) : 1.0;
  run_kernel(in.logits, in.labels, losses, grad, at::Tensor(), ignore_index, label_smoothing,
             grad_scale, at::Tensor());
  return {reduce_losses(losses, in.reduction, labelled), with_grad ? grad : nothing(logits)};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& saved_grad,
                                  const std::string& reduction) {
  check_cross_entropy_grad(grad, saved_grad, reduction, check_cpu);
  return scaled(saved_grad, grad.to(acc_dtype(saved_grad.scalar_type())).contiguous());
}

std::tuple<at::Tensor, at::Tensor> distillation_loss_forward(const at::Tensor& student_logits,
                                                             const at::Tensor& teacher_logits,
                                                             double temperature,
                                                             const std::string& reduction,
                                                             bool with_grad) {
  check_cpu(student_logits, "student_logits");
  check_cpu(teacher_logits, "teacher_logits");
  TORCH_CHECK_VALUE(student_logits.dim() >= 1 && student_logits.size(-1) > 0,
                    "student_logits must have a last dimension of at least one class, got shape ",
                    student_logits.sizes());
  TORCH_CHECK_VALUE(teacher_logits.sizes() == student_logits.sizes(),
                    "teacher_logits must have student_logits' shape ", student_logits.sizes(),
                    ", got ", teacher_logits.sizes());
  TORCH_CHECK_TYPE(teacher_logits.scalar_type() == student_logits.scalar_type(),
                   "teacher_logits must have student_logits' dtype");
  TORCH_CHECK_VALUE(temperature > 0 && std::isfinite(temperature),
                    "temperature must be a positive float, got ", temperature);
  const auto red = parse_reduction(reduction);
  const auto dtype = kernel_dtype(student_logits);
  const auto s = as_rows(student_logits), t = as_rows(teacher_logits);
  const int64_t rows = s.size(0), classes = s.size(1);
  auto losses = at::empty(student_logits.sizes().slice(0, student_logits.dim() - 1),
                          s.options().dtype(acc_dtype(student_logits.scalar_type())));
  auto grad = with_grad ? at::empty(student_logits.sizes(), s.options()) : at::Tensor();
  const double grad_scale = red == Reduction::kMean ? 1.0 / std::max<int64_t>(rows, 1) : 1.0;
  const size_t elem = s.element_size(), acc = losses.element_size();
  const char* x = static_cast<const char*>(s.data_ptr());
  const char* y = static_cast<const char*>(t.data_ptr());
  char* l = static_cast<char*>(losses.data_ptr());
  char* g = grad.defined() ? static_cast<char*>(grad.data_ptr()) : nullptr;
  at::parallel_for(0, rows, grain_rows(classes), [&](int64_t begin, int64_t end) {
    const int64_t at = begin * classes * elem;
    cpu_kernels().distillation_loss_forward(dtype, x + at, y + at, l + begin * acc,
                                            g ? g + at : nullptr, end - begin, classes,
                                            temperature, grad_scale);
  });
  return {reduce_losses(losses, red, rows), with_grad ? grad : nothing(student_logits)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
    bool need_dbias) {
  kernel_dtype(hidden);
  return masked_lm_loss_forward_on(kCpuMlm, hidden, weight, bias, labels, ignore_index,
                                   label_smoothing, reduction, chunk_rows, need_dhidden,
                                   need_dweight, need_dbias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
    const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias) {
  kernel_dtype(hidden);
  return masked_lm_loss_backward_on(kCpuMlm, grad, hidden, weight, bias, labels, dhidden,
                                    dweight, dbias, ignore_index, label_smoothing, reduction,
                                    chunk_rows, need_dhidden, need_dweight, need_dbias);
}

}  // namespace fusedlm
