// cross_entropy and masked_lm_loss on CUDA, the host side: checks, launch shapes and
// launches of the kernels in kernels/cuda/cross_entropy.cuh (which describes them), and
// masked_lm_loss's chunked projections with ATen's matrix products.
#include <algorithm>

#include "cross_entropy.cuh"
#include "cuda/common.h"
#include "ops.h"
#include "cuda/runtime.h"

namespace fusedlm::cuda {
namespace {

using namespace kernels::cross_entropy;

// The fused kernel over logits2 [rows, classes] (contiguous) and labels1 [rows]: losses
// (float32, rows elements, contiguous) receive the losses; grad is undefined (loss only) or
// the contiguous memory of rows * classes elements, possibly logits2 itself; scale is a
// one-element float32 tensor, row_scale undefined or float32 [rows].
void run_kernel(const at::Tensor& logits2, const at::Tensor& labels1, const at::Tensor& losses,
                const at::Tensor& grad, const at::Tensor& scale, const at::Tensor& row_scale,
                int64_t ignore_index, double label_smoothing) {
  const int64_t rows = logits2.size(0), classes = logits2.size(1);
  if (rows == 0) return;
  dispatch(logits2.scalar_type(), "logits", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* xp = ptr<T>(logits2);
    T* gp = ptr<T>(grad);
    // Each row's misalignment is then the same in both buffers.
    const bool vector = all_aligned16(xp, gp);
    const int threads = static_cast<int>(
        std::min<int64_t>(kThreads, ceil_div(ceil_div(classes, vector ? V : 1), 32) * 32));
    const int64_t* lp = ptr<int64_t>(labels1);
    float *loss = ptr<float>(losses), *sp = ptr<float>(scale), *rs = ptr<float>(row_scale);
    if (vector)
      launch(cross_entropy_kernel<T, V>, rows, threads, kSharedBytes, xp, lp, loss, gp, sp, rs,
             classes, ignore_index, float(label_smoothing));
    else
      launch(cross_entropy_kernel<T, 1>, rows, threads, kSharedBytes, xp, lp, loss, gp, sp, rs,
             classes, ignore_index, float(label_smoothing));
  });
}

// src * scale rounded once to src's dtype; scale (float32 on the device) holds one value,
// or one per row of src viewed as [scale.numel(), -1]. Undefined for an undefined src.
at::Tensor scaled(const at::Tensor& src, const at::Tensor& scale) {
  if (!src.defined()) return src;
  auto in = src.contiguous();
  auto out = at::empty_like(in);
  const int64_t n = in.numel();
  if (n == 0) return out;
  const bool per_row = scale.numel() > 1;
  const int64_t cols = per_row ? n / scale.numel() : n;
  dispatch(in.scalar_type(), "the gradient", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* ip = ptr<T>(in);
    T* op = ptr<T>(out);
    const bool vector = cols % V == 0 && all_aligned16(ip, op);
    const int64_t vecs = vector ? n / V : n;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(vecs, threads), int64_t(multiprocessors()) * 8);
    const float* sp = ptr<float>(scale);
    if (vector)
      launch(scale_kernel<T, V>, blocks, threads, 0, ip, op, sp, vecs, cols, per_row);
    else
      launch(scale_kernel<T, 1>, blocks, threads, 0, ip, op, sp, vecs, cols, per_row);
  });
  return out;
}

// The loss a reduction returns from the per-row losses (float32); labelled: how many rows
// count for the mean (a device tensor, so nothing synchronises).
at::Tensor reduce_losses(const at::Tensor& losses, Reduction reduction, const at::Tensor& labelled) {
  auto total = losses.sum(at::kDouble);
  if (reduction == Reduction::kMean) total = total / labelled.clamp_min(1).to(at::kDouble);
  return total.to(at::kFloat);
}

// The masked-LM head's inputs, checked, with the labelled rows found.
MlmInputs cuda_mlm_inputs(const at::Tensor& hidden, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                          int64_t ignore_index, double label_smoothing, int64_t chunk_rows) {
  auto in = mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing, chunk_rows,
                       check_device_tensor);
  // The one synchronisation of the op: the labelled rows' count sizes every chunk.
  in.labelled = at::nonzero(in.labels != ignore_index).view(-1);
  return in;
}

// Gradients folded in chunk by chunk; a gradient not asked for stays undefined.
struct MlmGrads {
  at::Tensor dhidden;  // hidden's shape, zero on the rows that are not labelled
  at::Tensor dweight;  // [V, H]
  at::Tensor dbias;    // [V], float32
};

// Projects the labelled rows chunk by chunk and runs the fused kernel on each chunk.
// Returns their losses (float32 [n]). With grads, each chunk's gradient,
// scale * row_scale[row] * d(loss_row)/d(logits), is folded into the gradients asked for
// (scale: one float32 on the device; row_scale: undefined, or float32 [rows]).
at::Tensor project_chunks(const MlmInputs& in, const at::Tensor& scale, const at::Tensor& row_scale,
                          MlmGrads* grads) {
  const int64_t n = in.labelled.numel(), vocab = in.weight.size(0);
  auto losses = at::empty({n}, in.hidden.options().dtype(at::kFloat));
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
    run_kernel(logits, in.labels.index_select(0, rows), losses.narrow(0, c0, m),
               grads ? logits : at::Tensor(), scale,
               row_scale.defined() ? row_scale.index_select(0, rows) : at::Tensor(),
               in.ignore_index, in.label_smoothing);
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
    if (grads->dbias.defined()) grads->dbias.add_(logits.sum(0, false, at::kFloat));
  }
  return losses;
}

// The gradients asked for, allocated in their final shapes: an op's output must not be a view.
MlmGrads mlm_grads(const MlmInputs& in, at::IntArrayRef hidden_shape, bool dhidden, bool dweight,
                   bool dbias) {
  MlmGrads g;
  if (dhidden) g.dhidden = at::zeros(hidden_shape, in.hidden.options());
  // Written whole by the first chunk's product; zeros when no row is labelled.
  if (dweight) g.dweight = in.labelled.numel() ? at::empty_like(in.weight) : at::zeros_like(in.weight);
  if (dbias && in.bias.defined())
    g.dbias = at::zeros({in.weight.size(0)}, in.hidden.options().dtype(at::kFloat));
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grads_out(const MlmGrads& g, const at::Tensor& hidden,
                                                         const at::Tensor& weight,
                                                         const std::optional<at::Tensor>& bias) {
  return {g.dhidden.defined() ? g.dhidden : nothing(hidden),
          g.dweight.defined() ? g.dweight : nothing(weight),
          g.dbias.defined() ? g.dbias.to(bias->scalar_type()) : nothing(weight)};
}

at::Tensor unit_scale(const at::Tensor& like, double value) {
  return at::full({1}, value, like.options().dtype(at::kFloat));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad) {
  const auto in = cross_entropy_inputs(logits, labels, reduction, check_device_tensor);
  const DeviceGuard guard(logits);
  const auto labelled = (in.labels != ignore_index).sum();
  const auto scale = in.reduction == Reduction::kMean
                         ? at::reciprocal(labelled.clamp_min(1).to(at::kFloat)).view({1})
                         : unit_scale(in.logits, 1.0);
  // Outputs in their final shapes, contiguous (the kernel writes them as rows): an op's
  // output must not be a view.
  auto losses = at::empty(labels.sizes(), in.logits.options().dtype(at::kFloat));
  auto grad = with_grad ? at::empty(logits.sizes(), in.logits.options()) : at::Tensor();
  run_kernel(in.logits, in.labels, losses, grad, scale, at::Tensor(), ignore_index,
             label_smoothing);
  return {in.reduction == Reduction::kNone ? losses : reduce_losses(losses, in.reduction, labelled),
          with_grad ? grad : nothing(logits)};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& saved_grad,
                                  const std::string& reduction) {
  check_cross_entropy_grad(grad, saved_grad, reduction, check_device_tensor);
  const DeviceGuard guard(saved_grad);
  return scaled(saved_grad, grad.to(at::kFloat).contiguous());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
    bool need_dbias) {
  const auto red = parse_reduction(reduction);
  check_device_tensor(hidden, "hidden");
  const DeviceGuard guard(hidden);
  const auto in = cuda_mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                  chunk_rows);
  const int64_t labelled = in.labelled.numel();
  // With reduction "none" grad_output weighs each row: the gradients wait for the backward.
  const bool with_grads = red != Reduction::kNone && (need_dhidden || need_dweight || need_dbias);
  MlmGrads g = with_grads ? mlm_grads(in, hidden.sizes(), need_dhidden, need_dweight, need_dbias)
                          : MlmGrads();
  const double grad_scale = red == Reduction::kMean ? 1.0 / std::max<int64_t>(labelled, 1) : 1.0;
  auto losses = project_chunks(in, unit_scale(in.hidden, grad_scale), at::Tensor(),
                               with_grads ? &g : nullptr);
  at::Tensor loss;
  if (red == Reduction::kNone) {
    loss = at::zeros(labels.sizes(), losses.options());
    loss.view(in.labels.sizes()).index_copy_(0, in.labelled, losses);
  } else {
    auto total = losses.sum(at::kDouble);
    if (red == Reduction::kMean) total = total / double(std::max<int64_t>(labelled, 1));
    loss = total.to(at::kFloat);
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
  check_device_tensor(hidden, "hidden");
  check_same_device(grad, hidden, "grad", "hidden");
  const DeviceGuard guard(hidden);
  if (parse_reduction(reduction) != Reduction::kNone) {
    TORCH_CHECK_VALUE(grad.numel() == 1, "grad must have one element, got ", grad.numel());
    const auto s = grad.to(at::kFloat).contiguous().view({1});
    return {scaled(dhidden, s), scaled(dweight, s), scaled(dbias, s)};
  }
  // Per-row grad_output: redo the chunks, each row's gradient scaled by its grad_output.
  const auto in = cuda_mlm_inputs(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                  chunk_rows);
  TORCH_CHECK_VALUE(grad.numel() == in.labels.numel(), "grad must have ", in.labels.numel(),
                    " elements, got ", grad.numel());
  MlmGrads g = mlm_grads(in, hidden.sizes(), need_dhidden, need_dweight, need_dbias);
  project_chunks(in, unit_scale(in.hidden, 1.0), grad.to(at::kFloat).contiguous().view(-1), &g);
  return grads_out(g, hidden, weight, bias);
}

}  // namespace fusedlm::cuda
