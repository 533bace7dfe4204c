#include "checks.h"

#include "common.h"

namespace fusedlm {
namespace {

void check_labels(const at::Tensor& labels, const at::Tensor& like, at::IntArrayRef batch_shape,
                  DeviceCheck device) {
  device(labels, "labels");
  check_same_device(labels, like, "labels", "the logits");
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong, "labels must be int64, got ",
                   labels.scalar_type());
  TORCH_CHECK_VALUE(labels.sizes() == batch_shape, "labels must have shape ", batch_shape,
                    ", got ", labels.sizes());
}

at::IntArrayRef batch_shape(const at::Tensor& t) { return t.sizes().slice(0, t.dim() - 1); }

}  // namespace

void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* name,
                       const char* other) {
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", other, "'s device (",
                    like.device(), "), got ", t.device());
}

at::Tensor as_rows(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 1, "expected a tensor of at least one dimension, got a scalar");
  auto rows = t.contiguous();
  if (rows.dim() == 2) return rows;  // (a view costs a dispatch, which small calls feel)
  const auto sizes = t.sizes();
  return rows.view({c10::multiply_integers(sizes.begin(), sizes.end() - 1), sizes.back()});
}

at::Tensor nothing(const at::Tensor& like) { return at::empty({0}, like.options()); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(-1) > 0, name, " must have a non-empty last dimension");
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name, const char* other,
                DeviceCheck device) {
  device(t, name);
  check_same_device(t, like, name, other);
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", other, " ",
                    like.sizes(), ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ", other,
                   " (", like.scalar_type(), "), got ", t.scalar_type());
}

void check_operand(const at::Tensor& t, const at::Tensor& x, const char* name, DeviceCheck device) {
  device(t, name);
  check_same_device(t, x, name, "x");
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), name, " must have the dtype of x (",
                   x.scalar_type(), "), got ", t.scalar_type());
}

at::Tensor vector_param(const std::optional<at::Tensor>& t, const at::Tensor& x, int64_t size,
                        const char* name, DeviceCheck device) {
  if (!present(t)) return at::Tensor();
  device(*t, name);
  check_same_device(*t, x, name, "x");
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == size, name, " must have shape [", size,
                    "], got ", t->sizes());
  TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(), name, " must have the dtype of x (",
                   x.scalar_type(), "), got ", t->scalar_type());
  return t->contiguous();
}

at::Tensor param(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name,
                 DeviceCheck device) {
  return vector_param(t, x, x.size(-1), name, device);
}

void check_statistics(const at::Tensor& t, const char* name, int64_t rows, at::ScalarType dtype,
                      const at::Tensor& like, const char* other, DeviceCheck device) {
  device(t, name);
  check_same_device(t, like, name, other);
  TORCH_CHECK_VALUE(t.numel() == rows && t.scalar_type() == dtype && t.is_contiguous(), name,
                    " must be the forward's statistics");
}

RowInputs row_inputs(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     DeviceCheck device) {
  device(x, "x");
  check_rows(x, "x");
  RowInputs in;
  in.weight = param(weight, x, "weight", device);
  in.x = x.contiguous();
  in.cols = x.size(-1);
  in.rows = x.numel() / in.cols;  // (check_rows: cols > 0)
  return in;
}

RowInputs row_grad_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                          const std::optional<at::Tensor>& weight, DeviceCheck device) {
  RowInputs in = row_inputs(x, weight, device);
  check_like(grad_out, x, "grad_out", "x", device);
  in.grad_out = grad_out.contiguous();
  return in;
}

LayerNormInputs add_layer_norm_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, DeviceCheck device) {
  LayerNormInputs in;
  static_cast<RowInputs&>(in) = row_inputs(x, weight, device);
  if (present(residual)) {
    check_like(*residual, x, "residual", "x", device);
    in.residual = residual->contiguous();
  }
  in.bias = param(bias, x, "bias", device);
  return in;
}

LayerNormGradInputs add_layer_norm_grad_inputs(const at::Tensor& grad_out,
                                               const std::optional<at::Tensor>& grad_summed,
                                               const at::Tensor& summed, const at::Tensor& mean,
                                               const at::Tensor& rstd,
                                               const std::optional<at::Tensor>& weight,
                                               at::ScalarType stat_dtype, bool dropout,
                                               bool has_residual, DeviceCheck device) {
  device(summed, "summed");
  check_rows(summed, "summed");
  check_like(grad_out, summed, "grad_out", "summed", device);
  LayerNormGradInputs in;
  if (present(grad_summed)) {
    check_like(*grad_summed, summed, "grad_summed", "summed", device);
    in.grad_summed = as_rows(*grad_summed);
  }
  in.weight = param(weight, summed, "weight", device);
  in.grad_out = as_rows(grad_out);
  in.summed = as_rows(summed);
  check_statistics(mean, "mean", in.summed.size(0), stat_dtype, summed, "summed", device);
  check_statistics(rstd, "rstd", in.summed.size(0), stat_dtype, summed, "summed", device);
  // Without dropout dx is dsummed itself (the caller hands one tensor to both x and
  // residual); with it, dsummed is written only for a residual.
  if (!dropout || has_residual) in.dsummed = at::empty(summed.sizes(), in.summed.options());
  if (dropout) in.dx = at::empty(summed.sizes(), in.summed.options());
  return in;
}

bool gelu_tanh(const std::string& approximate) { return approximate == "tanh"; }

BiasGeluInputs bias_gelu_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                const std::string& approximate, DeviceCheck device) {
  device(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension");
  return {as_rows(x), param(bias, x, "bias", device), at::Tensor(), gelu_tanh(approximate)};
}

BiasGeluInputs bias_gelu_grad_inputs(const at::Tensor& grad, const at::Tensor& x,
                                     const std::optional<at::Tensor>& bias,
                                     const std::string& approximate, DeviceCheck device) {
  auto in = bias_gelu_inputs(x, bias, approximate, device);
  check_like(grad, x, "grad", "x", device);
  in.grad = as_rows(grad);
  return in;
}

namespace {

std::vector<int64_t> with_last(const at::Tensor& x, int64_t last) {
  auto sizes = x.sizes().vec();
  sizes.back() = last;
  return sizes;
}

}  // namespace

at::Tensor ffn_output(const at::Tensor& x, const at::Tensor& act, const at::Tensor& w2,
                      const at::Tensor& b2) {
  auto y = at::empty(with_last(x, w2.size(0)), act.options());
  auto rows = y.view({act.size(0), w2.size(0)});
  if (b2.defined())
    at::addmm_out(rows, b2, act, w2.t());
  else
    at::mm_out(rows, act, w2.t());
  return y;
}

FfnGrads ffn_backward_products(const GeluFfnInputs& in, const at::Tensor& x, const at::Tensor& g2,
                               const at::Tensor& act, const at::Tensor& dpre) {
  FfnGrads g;
  g.dw2 = at::mm(g2.t(), act);
  if (in.b2.defined())
    g.db2 = g2.sum(0, false, acc_dtype(g2.scalar_type())).to(in.b2.scalar_type());
  g.dx = at::empty(x.sizes(), in.x.options());
  auto dx_rows = g.dx.view(in.x.sizes());
  at::mm_out(dx_rows, dpre, in.w1);
  g.dw1 = at::mm(dpre.t(), in.x);
  return g;
}

GeluFfnInputs gelu_ffn_inputs(const at::Tensor& x, const at::Tensor& w1,
                              const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                              const std::optional<at::Tensor>& b2, const std::string& approximate,
                              DeviceCheck device) {
  device(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension");
  check_operand(w1, x, "w1", device);
  TORCH_CHECK_VALUE(w1.dim() == 2 && w1.size(1) == x.size(-1), "w1 must have shape [d_ff, ",
                    x.size(-1), "], got ", w1.sizes());
  const int64_t d_ff = w1.size(0);
  check_operand(w2, x, "w2", device);
  TORCH_CHECK_VALUE(w2.dim() == 2 && w2.size(1) == d_ff, "w2 must have shape [d_out, ", d_ff,
                    "], got ", w2.sizes());
  return {as_rows(x),
          w1.contiguous(),
          vector_param(b1, x, d_ff, "b1", device),
          w2.contiguous(),
          vector_param(b2, x, w2.size(0), "b2", device),
          at::Tensor(),
          at::Tensor(),
          gelu_tanh(approximate)};
}

GeluFfnInputs gelu_ffn_grad_inputs(const at::Tensor& grad, const at::Tensor& x,
                                   const at::Tensor& pre_activation, const at::Tensor& w1,
                                   const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                                   const std::optional<at::Tensor>& b2,
                                   const std::string& approximate, DeviceCheck device) {
  auto in = gelu_ffn_inputs(x, w1, b1, w2, b2, approximate, device);
  const int64_t rows = in.x.size(0), d_ff = in.w1.size(0), d_out = in.w2.size(0);
  check_operand(grad, x, "grad", device);
  const auto grad_shape = with_last(x, d_out);
  TORCH_CHECK_VALUE(grad.sizes() == at::IntArrayRef(grad_shape), "grad must have shape ",
                    at::IntArrayRef(grad_shape), ", got ", grad.sizes());
  check_operand(pre_activation, x, "pre_activation", device);
  TORCH_CHECK_VALUE(pre_activation.sizes() == at::IntArrayRef({rows, d_ff}),
                    "pre_activation must have shape [", rows, ", ", d_ff, "], got ",
                    pre_activation.sizes());
  in.grad = as_rows(grad);
  in.pre_activation = pre_activation.contiguous();
  return in;
}

Reduction parse_reduction(const std::string& reduction) {
  if (reduction == "none") return Reduction::kNone;
  return reduction == "sum" ? Reduction::kSum : Reduction::kMean;
}

CrossEntropyInputs cross_entropy_inputs(const at::Tensor& logits, const at::Tensor& labels,
                                        const std::string& reduction, DeviceCheck device) {
  device(logits, "logits");
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) > 0,
                    "logits must have a last dimension of at least one class, got shape ",
                    logits.sizes());
  check_labels(labels, logits, batch_shape(logits), device);
  const auto red = parse_reduction(reduction);
  return {as_rows(logits), labels.dim() == 1 ? labels.contiguous() : labels.contiguous().view(-1),
          red};
}

void check_cross_entropy_grad(const at::Tensor& grad, const at::Tensor& saved_grad,
                              const std::string& reduction, DeviceCheck device) {
  device(saved_grad, "saved_grad");
  device(grad, "grad");
  check_same_device(grad, saved_grad, "grad", "saved_grad");
  check_rows(saved_grad, "saved_grad");
  const int64_t rows = saved_grad.numel() / saved_grad.size(-1);
  const int64_t scales = parse_reduction(reduction) == Reduction::kNone ? rows : 1;
  TORCH_CHECK_VALUE(grad.numel() == scales, "grad must have ", scales, " elements, got ",
                    grad.numel());
}

MlmInputs mlm_inputs(const at::Tensor& hidden, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                     int64_t ignore_index, double label_smoothing, int64_t chunk_rows,
                     DeviceCheck device) {
  device(hidden, "hidden");
  device(weight, "weight");
  check_same_device(weight, hidden, "weight", "hidden");
  TORCH_CHECK_VALUE(hidden.dim() >= 1, "hidden must have at least 1 dimension");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(-1) && weight.size(0) > 0,
                    "weight must have shape [vocab, ", hidden.size(-1), "], got ", weight.sizes());
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), "weight must have dtype ",
                   hidden.scalar_type(), ", got ", weight.scalar_type());
  if (present(bias)) {
    device(*bias, "bias");
    check_same_device(*bias, hidden, "bias", "hidden");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "bias must have shape [", weight.size(0), "], got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == hidden.scalar_type(), "bias must have dtype ",
                     hidden.scalar_type(), ", got ", bias->scalar_type());
  }
  check_labels(labels, hidden, batch_shape(hidden), device);
  TORCH_CHECK_VALUE(chunk_rows > 0, "chunk_rows must be positive, got ", chunk_rows);
  return {as_rows(hidden),
          weight.contiguous(),
          present(bias) ? bias->contiguous() : at::Tensor(),
          labels.contiguous().view(-1),
          at::Tensor(),
          ignore_index,
          label_smoothing,
          chunk_rows};
}

}  // namespace fusedlm
