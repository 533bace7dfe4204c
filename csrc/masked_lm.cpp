#include "masked_lm.h"

#include <algorithm>

#include "common.h"

namespace fusedlm {
namespace {

// Gradients folded in chunk by chunk; a gradient not asked for stays undefined.
struct MlmGrads {
  at::Tensor dhidden;  // hidden's shape, zero on the rows that are not labelled
  at::Tensor dweight;  // [V, H]
  at::Tensor dbias;    // [V], accumulation dtype
};

// The inputs, checked, with the labelled rows found.
MlmInputs inputs(const MlmBackend& backend, const at::Tensor& hidden, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                 int64_t ignore_index, double label_smoothing, int64_t chunk_rows) {
  auto in = mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing, chunk_rows,
                       backend.device);
  in.labelled = backend.labelled(in.labels, in.weight.size(0), ignore_index);
  return in;
}

// Products of a long inner dimension on the CPU are summed in blocks of this many, in order:
// BLAS may split a longer one between threads, and its sum's order then depends on how many
// there are (fusedlm's CPU kernels give the same bits on any number of threads).
constexpr int64_t kOrderedInner = 256;

// out = a @ b, or out += a @ b with accumulate; on the CPU in blocks of kOrderedInner.
void ordered_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const int64_t inner = a.size(1);
  const int64_t block = a.is_cpu() ? kOrderedInner : inner;
  for (int64_t k0 = 0; k0 < inner; k0 += block) {
    const int64_t len = std::min(block, inner - k0);
    const auto a_part = a.narrow(1, k0, len), b_part = b.narrow(0, k0, len);
    if (k0 == 0 && !accumulate)
      at::mm_out(out, a_part, b_part);
    else
      out.addmm_(a_part, b_part);
  }
}

// Projects the labelled rows chunk by chunk and runs the backend's cross-entropy on each.
// Returns their losses [n] (accumulation dtype). With grads, each chunk's gradient,
// grad_scale * row_scale[row] * d(loss_row)/d(logits), is folded into the gradients
// asked for (row_scale: undefined, or [rows] in the accumulation dtype).
at::Tensor project_chunks(const MlmBackend& backend, const MlmInputs& in, double grad_scale,
                          const at::Tensor& row_scale, MlmGrads* grads) {
  const int64_t n = in.labelled.numel(), vocab = in.weight.size(0);
  auto losses = at::empty({n}, in.hidden.options().dtype(acc_dtype(in.hidden.scalar_type())));
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
    const auto col_sum = backend.chunk(
        logits, in.labels.index_select(0, rows), losses.narrow(0, c0, m), grads != nullptr,
        grads && grads->dbias.defined(), in.ignore_index, in.label_smoothing, grad_scale,
        row_scale.defined() ? row_scale.index_select(0, rows) : at::Tensor());
    if (!grads) continue;
    // logits now holds the chunk's gradient.
    if (grads->dhidden.defined()) {
      auto dh = at::empty({m, in.weight.size(1)}, logits.options());
      ordered_mm(dh, logits, in.weight, false);
      grads->dhidden.view(in.hidden.sizes()).index_copy_(0, rows, dh);
    }
    if (grads->dweight.defined()) ordered_mm(grads->dweight, logits.t(), h, c0 != 0);
    if (grads->dbias.defined()) grads->dbias.add_(col_sum);
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
  if (dbias && in.bias.defined())
    g.dbias = at::zeros({in.weight.size(0)}, in.hidden.options().dtype(acc));
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward_on(
    const MlmBackend& backend, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias) {
  const auto red = parse_reduction(reduction);
  const auto in =
      inputs(backend, hidden, weight, bias, labels, ignore_index, label_smoothing, chunk_rows);
  const int64_t labelled = in.labelled.numel();
  // With reduction "none" grad_output weighs each row: the gradients wait for the backward.
  const bool with_grads = red != Reduction::kNone && (need_dhidden || need_dweight || need_dbias);
  MlmGrads g = with_grads ? mlm_grads(in, hidden.sizes(), need_dhidden, need_dweight, need_dbias)
                          : MlmGrads();
  const double grad_scale = red == Reduction::kMean ? 1.0 / std::max<int64_t>(labelled, 1) : 1.0;
  auto losses = project_chunks(backend, in, grad_scale, at::Tensor(), with_grads ? &g : nullptr);
  at::Tensor loss;
  if (red == Reduction::kNone) {
    loss = at::zeros(labels.sizes(), losses.options());
    loss.view(in.labels.sizes()).index_copy_(0, in.labelled, losses);
  } else {
    loss = backend.reduce(losses, red, labelled);
  }
  auto [dh, dw, db] = grads_out(g, hidden, weight, bias);
  return {loss, dh, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward_on(
    const MlmBackend& backend, const at::Tensor& grad, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels,
    const at::Tensor& dhidden, const at::Tensor& dweight, const at::Tensor& dbias,
    int64_t ignore_index, double label_smoothing, const std::string& reduction,
    int64_t chunk_rows, bool need_dhidden, bool need_dweight, bool need_dbias) {
  backend.device(grad, "grad");
  check_same_device(grad, hidden, "grad", "hidden");
  const auto acc = acc_dtype(hidden.scalar_type());
  if (parse_reduction(reduction) != Reduction::kNone) {
    TORCH_CHECK_VALUE(grad.numel() == 1, "grad must have one element, got ", grad.numel());
    const auto s = grad.to(acc).contiguous().view({1});
    return {backend.scaled(dhidden, s), backend.scaled(dweight, s), backend.scaled(dbias, s)};
  }
  // Per-row grad_output: redo the chunks, each row's gradient scaled by its grad_output.
  const auto in =
      inputs(backend, hidden, weight, bias, labels, ignore_index, label_smoothing, chunk_rows);
  TORCH_CHECK_VALUE(grad.numel() == in.labels.numel(), "grad must have ", in.labels.numel(),
                    " elements, got ", grad.numel());
  MlmGrads g = mlm_grads(in, hidden.sizes(), need_dhidden, need_dweight, need_dbias);
  project_chunks(backend, in, 1.0, grad.to(acc).contiguous().view(-1), &g);
  return grads_out(g, hidden, weight, bias);
}

}  // namespace fusedlm
