// cross_entropy and masked_lm_loss on the CPU.
//
// cross_entropy: one pass of the fused kernel gives the per-row losses and, in a new
// buffer, d(loss)/d(logits), already divided by the number of labelled rows for
// "mean". The backward only scales that buffer by grad_output.
//
// masked_lm_loss: rows whose label is ignore_index never reach the vocabulary
// projection. The labelled rows are gathered and projected chunk_rows at a time into
// one reused [chunk_rows, vocab] logits buffer; the fused kernel overwrites a chunk's
// logits with their gradient (and sums its columns, the bias gradient), and ATen's
// matrix products fold that into d_hidden and d_weight before the next chunk. Only one
// chunk of logits ever exists.
#include <algorithm>
#include <vector>

#include "checks.h"
#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// Rows of a [rows, cols] tensor each task takes; keeps tasks near 64 KiB of input.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// The flat positions whose label is not ignore_index, in order. Every other label must
// be a class index: the kernel reads logits[label] unchecked.
std::vector<int64_t> labelled_rows(const at::Tensor& labels1, int64_t classes, int64_t ignore_index) {
  const int64_t* y = labels1.data_ptr<int64_t>();
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < labels1.numel(); ++i) {
    if (y[i] == ignore_index) continue;
    TORCH_CHECK_VALUE(0 <= y[i] && y[i] < classes, "labels must be class indices in [0, ",
                      classes, ") or ignore_index (", ignore_index, "), got ", y[i],
                      " at flat position ", i);
    rows.push_back(i);
  }
  return rows;
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

// The loss a reduction returns from the per-row losses (contiguous, accumulation dtype).
// Sums run in float64 and in row order, so they do not depend on the thread count.
at::Tensor reduce_losses(const at::Tensor& losses, Reduction reduction, int64_t labelled) {
  if (reduction == Reduction::kNone) return losses;
  double total = 0.0;
  AT_DISPATCH_FLOATING_TYPES(losses.scalar_type(), "reduce_losses", [&] {
    const scalar_t* l = losses.data_ptr<scalar_t>();
    for (int64_t i = 0; i < losses.numel(); ++i) total += l[i];
  });
  if (reduction == Reduction::kMean) total /= std::max<int64_t>(labelled, 1);
  return at::scalar_tensor(total, losses.options());
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

// The masked-LM head's inputs, checked, with the labelled rows found.
MlmInputs cpu_mlm_inputs(const at::Tensor& hidden, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                         int64_t ignore_index, double label_smoothing, int64_t chunk_rows) {
  auto in = mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing, chunk_rows,
                       check_cpu);
  kernel_dtype(hidden);
  auto rows = labelled_rows(in.labels, weight.size(0), ignore_index);
  in.labelled = at::empty({static_cast<int64_t>(rows.size())}, labels.options());
  std::copy(rows.begin(), rows.end(), in.labelled.data_ptr<int64_t>());
  return in;
}

// Gradients folded in chunk by chunk; a gradient not asked for stays undefined.
struct MlmGrads {
  at::Tensor dhidden;  // hidden's shape, zero on the rows that are not labelled
  at::Tensor dweight;  // [V, H]
  at::Tensor dbias;    // [V], accumulation dtype
};

// Projects the labelled rows chunk by chunk and runs the fused kernel on each chunk.
// Returns their losses [n] (accumulation dtype). With grads, each chunk's gradient,
// grad_scale * row_scale[row] * d(loss_row)/d(logits), is folded into the gradients
// asked for (row_scale: undefined, or [rows] in the accumulation dtype).
at::Tensor project_chunks(const MlmInputs& in, double grad_scale, const at::Tensor& row_scale,
                          MlmGrads* grads) {
  const int64_t n = in.labelled.numel(), vocab = in.weight.size(0);
  const auto acc = acc_dtype(in.hidden.scalar_type());
  auto losses = at::empty({n}, in.hidden.options().dtype(acc));
  if (n == 0) return losses;
  const int64_t chunk = std::min(in.chunk_rows, n);
  auto buffer = at::empty({chunk, vocab}, in.hidden.options());
  const auto weight_t = in.weight.t();
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t m = std::min(chunk, n - c0);
    const auto rows = in.labelled.narrow(0, c0, m);
    const auto h = in.hidden.index_select(0, rows);
    auto logits = buffer.narrow(0, 0, m);
    if (in.bias.defined())
      at::addmm_out(logits, in.bias, h, weight_t);
    else
      at::mm_out(logits, h, weight_t);
    const bool dbias = grads && grads->dbias.defined();
    auto partial = dbias ? at::empty({(m + kReduceBlockRows - 1) / kReduceBlockRows, vocab},
                                     in.hidden.options().dtype(acc))
                         : at::Tensor();
    run_kernel(logits, in.labels.index_select(0, rows), losses.narrow(0, c0, m),
               grads ? logits : at::Tensor(), partial, in.ignore_index, in.label_smoothing,
               grad_scale, row_scale.defined() ? row_scale.index_select(0, rows) : at::Tensor());
    if (!grads) continue;
    // logits now holds the chunk's gradient.
    if (grads->dhidden.defined())
      grads->dhidden.view(in.hidden.sizes()).index_copy_(0, rows, at::mm(logits, in.weight));
    if (grads->dweight.defined()) {
      if (c0 == 0)
        at::mm_out(grads->dweight, logits.t(), h);
      else
        grads->dweight.addmm_(logits.t(), h);
    }
    if (dbias) grads->dbias.add_(sum_partials(partial, acc));
  }
  return losses;
}

// The gradients asked for, allocated in their final shapes: an op's output must not be a view.
MlmGrads mlm_grads(const MlmInputs& in, at::IntArrayRef hidden_shape, bool dhidden, bool dweight,
                   bool dbias) {
  const auto acc = acc_dtype(in.hidden.scalar_type());
  MlmGrads g;
  if (dhidden) g.dhidden = at::zeros(hidden_shape, in.hidden.options());
  // Written whole by the first chunk's product; zeros when no row is labelled.
  if (dweight) g.dweight = in.labelled.numel() ? at::empty_like(in.weight) : at::zeros_like(in.weight);
  if (dbias && in.bias.defined()) g.dbias = at::zeros({in.weight.size(0)}, in.hidden.options().dtype(acc));
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grads_out(const MlmGrads& g, const at::Tensor& hidden,
                                                         const at::Tensor& weight,
                                                         const std::optional<at::Tensor>& bias) {
  return {g.dhidden.defined() ? g.dhidden : nothing(hidden),
          g.dweight.defined() ? g.dweight : nothing(weight),
          g.dbias.defined() ? g.dbias.to(bias->scalar_type()) : nothing(weight)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad) {
  const auto in = cross_entropy_inputs(logits, labels, reduction, check_cpu);
  kernel_dtype(logits);
  const int64_t labelled = labelled_rows(in.labels, in.logits.size(1), ignore_index).size();
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
    bool need_dbias) {
  const auto red = parse_reduction(reduction);
  const auto in = cpu_mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                 chunk_rows);
  const int64_t labelled = in.labelled.numel();
  // With reduction "none" grad_output weighs each row: the gradients wait for the backward.
  const bool with_grads = red != Reduction::kNone && (need_dhidden || need_dweight || need_dbias);
  MlmGrads g = with_grads ? mlm_grads(in, hidden.sizes(), need_dhidden, need_dweight, need_dbias)
                          : MlmGrads();
  const double grad_scale = red == Reduction::kMean ? 1.0 / std::max<int64_t>(labelled, 1) : 1.0;
  auto losses = project_chunks(in, grad_scale, at::Tensor(), with_grads ? &g : nullptr);
  at::Tensor loss;
  if (red == Reduction::kNone) {
    loss = at::zeros(labels.sizes(), losses.options());
    loss.view(in.labels.sizes()).index_copy_(0, in.labelled, losses);
  } else {
    loss = reduce_losses(losses, red, labelled);
  }
  auto [dh, dw, db] = grads_out(g, hidden, weight, bias);
  return {loss, dh, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
    const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias) {
  const auto acc = acc_dtype(hidden.scalar_type());
  if (parse_reduction(reduction) != Reduction::kNone) {
    TORCH_CHECK_VALUE(grad.numel() == 1, "grad must have one element, got ", grad.numel());
    const auto s = grad.to(acc).contiguous();
    return {scaled(dhidden, s), scaled(dweight, s), scaled(dbias, s)};
  }
  // Per-row grad_output: redo the chunks, each row's gradient scaled by its grad_output.
  const auto in = cpu_mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                 chunk_rows);
  TORCH_CHECK_VALUE(grad.numel() == in.labels.numel(), "grad must have ", in.labels.numel(),
                    " elements, got ", grad.numel());
  MlmGrads g = mlm_grads(in, hidden.sizes(), need_dhidden, need_dweight, need_dbias);
  project_chunks(in, 1.0, grad.to(acc).contiguous().view(-1), &g);
  return grads_out(g, hidden, weight, bias);
}

}  // namespace fusedlm
