// cross_entropy and masked_lm_loss on CUDA, the host side: checks, launch shapes and
// launches of the kernels in kernels/cuda/cross_entropy.cuh (which describes them), and
// the kernel masked_lm_loss's chunked projections (csrc/masked_lm.cpp) run on each chunk.
#include <algorithm>

#include "cross_entropy.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "masked_lm.h"
#include "ops.h"

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

at::Tensor unit_scale(const at::Tensor& like, double value) {
  return at::full({1}, value, like.options().dtype(at::kFloat));
}

// The one synchronisation of masked_lm_loss: the labelled rows' count sizes every chunk.
at::Tensor labelled_positions(const at::Tensor& labels1, int64_t, int64_t ignore_index) {
  return at::nonzero(labels1 != ignore_index).view(-1);
}

at::Tensor chunk_cross_entropy(const at::Tensor& logits, const at::Tensor& labels1,
                               const at::Tensor& losses, bool with_grad, bool col_sum,
                               int64_t ignore_index, double label_smoothing, double grad_scale,
                               const at::Tensor& row_scale) {
  run_kernel(logits, labels1, losses, with_grad ? logits : at::Tensor(),
             unit_scale(logits, grad_scale), row_scale, ignore_index, label_smoothing);
  return col_sum ? logits.sum(0, false, at::kFloat) : at::Tensor();
}

at::Tensor total(const at::Tensor& losses) { return losses.sum(at::kDouble); }

const MlmBackend kCudaMlm{check_device_tensor, labelled_positions, chunk_cross_entropy, total,
                          scaled};

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
  const DeviceGuard guard(hidden, "hidden");
  return masked_lm_loss_forward_on(kCudaMlm, hidden, weight, bias, labels, ignore_index,
                                   label_smoothing, reduction, chunk_rows, need_dhidden,
                                   need_dweight, need_dbias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
    const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias) {
  const DeviceGuard guard(hidden, "hidden");
  return masked_lm_loss_backward_on(kCudaMlm, grad, hidden, weight, bias, labels, dhidden,
                                    dweight, dbias, ignore_index, label_smoothing, reduction,
                                    chunk_rows, need_dhidden, need_dweight, need_dbias);
}

}  // namespace fusedlm::cuda
