// masked_lm_loss's host code, one for both backends: rows whose label is ignore_index
// never reach the vocabulary projection. The labelled rows are gathered and projected
// chunk_rows at a time (ATen's matrix products) into one reused [chunk_rows, vocab]
// logits buffer; the backend's fused cross-entropy overwrites a chunk's logits with their
// gradient, which the products fold into d_hidden and d_weight before the next chunk.
// Only one chunk of logits ever exists.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "checks.h"

namespace fusedlm {

// What a backend brings to the loop: its kernels, on tensors of its device. "acc" is the
// accumulation dtype of the inputs' (float64 for float64, else float32).
struct MlmBackend {
  DeviceCheck device;
  // The flat positions (int64 [n]) of labels1 [rows] whose label is not ignore_index.
  at::Tensor (*labelled)(const at::Tensor& labels1, int64_t classes, int64_t ignore_index);
  // Cross-entropy over the rows of contiguous logits [m, classes] with labels1 [m]: losses
  // (acc [m]) receive the losses. With with_grad the logits are overwritten with
  // grad_scale * row_scale[r] * d(loss_r)/d(logits) (row_scale undefined: 1, else acc [m]);
  // with col_sum also, the gradient's column sums (acc [classes]) are returned.
  at::Tensor (*chunk)(const at::Tensor& logits, const at::Tensor& labels1,
                      const at::Tensor& losses, bool with_grad, bool col_sum,
                      int64_t ignore_index, double label_smoothing, double grad_scale,
                      const at::Tensor& row_scale);
  // The loss reduction "mean" or "sum" returns from the losses (acc [n]) of `labelled` rows:
  // a scalar in acc, summed in float64.
  at::Tensor (*reduce)(const at::Tensor& losses, Reduction reduction, int64_t labelled);
  // src * scale (one acc value) in src's dtype, rounded once; undefined for undefined src.
  at::Tensor (*scaled)(const at::Tensor& src, const at::Tensor& scale);
};

// The loop on `backend`: what the entry points below run.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward_on(
    const MlmBackend& backend, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward_on(
    const MlmBackend& backend, const at::Tensor& grad, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels,
    const at::Tensor& dhidden, const at::Tensor& dweight, const at::Tensor& dbias,
    int64_t ignore_index, double label_smoothing, const std::string& reduction,
    int64_t chunk_rows, bool need_dhidden, bool need_dweight, bool need_dbias);

// The entry points of a backend whose MlmBackend is `backend`, each run while a `Guard`
// (constructed from hidden and its name) is held: the cuda backend's DeviceGuard, or the
// CPU's check of hidden's dtype. A backend binds them under their own names:
//   constexpr auto masked_lm_loss_forward = &MaskedLmLoss<kCpuMlm, CpuGuard>::forward;
template <const MlmBackend& backend, class Guard>
struct MaskedLmLoss {
  // cross_entropy(hidden @ weight^T + bias, labels), projecting only the rows whose label
  // is not ignore_index, chunk_rows of them at a time. Returns (loss, dhidden, dweight,
  // dbias): for reduction "mean"/"sum" the gradients asked for by need_* (for grad_output
  // 1), the others empty; for "none" every gradient is empty (the backward computes them).
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
      const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
      const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
      const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
      bool need_dbias) {
    const Guard guard(hidden, "hidden");
    return masked_lm_loss_forward_on(backend, hidden, weight, bias, labels, ignore_index,
                                     label_smoothing, reduction, chunk_rows, need_dhidden,
                                     need_dweight, need_dbias);
  }

  // (dhidden, dweight, dbias): the forward's gradients scaled by grad for "mean"/"sum";
  // for "none", recomputed chunk by chunk with each row scaled by its grad.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
      const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
      const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
      const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
      double label_smoothing, const std::string& reduction, int64_t chunk_rows,
      bool need_dhidden, bool need_dweight, bool need_dbias) {
    const Guard guard(hidden, "hidden");
    return masked_lm_loss_backward_on(backend, grad, hidden, weight, bias, labels, dhidden,
                                      dweight, dbias, ignore_index, label_smoothing, reduction,
                                      chunk_rows, need_dhidden, need_dweight, need_dbias);
  }
};

}  // namespace fusedlm
