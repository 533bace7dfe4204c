// cross_entropy, distillation_loss and masked_lm_loss (fusedlm/ops/cross_entropy.py): their
// schemas, their kernels' routing and their autograd. Each forward also returns the gradient
// for grad_output 1 where autograd records the call; the backward scales it by grad_output.
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/route.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

using ScaleBackward = Tensor(const Tensor&, const Tensor&, const std::string&);
constexpr char kCrossEntropyBackward[] = "fusedlm::cross_entropy_backward";
constexpr char kCrossEntropyBackwardKernel[] = "cross_entropy_backward";

// The backward of cross_entropy and distillation_loss: the gradient saved for grad_output 1,
// scaled. `caller` is the op the user called.
variable_list scaled_backward(AutogradContext* ctx, const variable_list& grads, int inputs,
                              const char* caller) {
  variable_list out(inputs);
  if (!grads[0].defined()) return out;  // the loss was not used
  const Tensor saved = ctx->get_saved_variables()[0];
  const std::string reduction = ctx->saved_data["reduction"].toStringRef();
  const std::string backend = ctx->saved_data["backend"].toStringRef();
  if (unit_grad(grads[0], reduction)) {
    out[0] = saved;
  } else if (needs_reference_backward(grads)) {
    out[0] = reference_backward("cross_entropy", backend, 0.0, caller, grads[0], saved, reduction)[0];
  } else {
    out[0] = dispatched<kCrossEntropyBackward, ScaleBackward>().call(grads[0], saved, reduction,
                                                                     backend);
  }
  return out;
}

// What cross_entropy and distillation_loss save: the gradient, which has none itself. Without
// set_materialize_grads(false) autograd would hand the backward a zero tensor for it, a
// transient copy of every gradient buffer.
void save_gradient(AutogradContext* ctx, const Tensor& grad, const std::string& reduction,
                   c10::string_view backend) {
  ctx->save_for_backward({grad});
  ctx->saved_data["reduction"] = reduction;
  ctx->saved_data["backend"] = std::string(backend);
  ctx->mark_non_differentiable({grad});
  ctx->set_materialize_grads(false);
}

// --- cross_entropy ----------------------------------------------------------------------------

using CrossEntropyForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, double,
                                                       const std::string&, bool);
using SymCrossEntropyForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, c10::SymInt,
                                                          double, const std::string&, bool);
constexpr char kCrossEntropy[] = "fusedlm::cross_entropy";
constexpr char kCrossEntropyForwardKernel[] = "cross_entropy_forward";

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels,
                               c10::SymInt ignore_index, double label_smoothing,
                               const std::string& reduction, bool with_grad,
                               c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, grad] = dispatched<kCrossEntropy, SymCrossEntropyForward>().call(
        logits, labels, ignore_index, label_smoothing, reduction, with_grad, backend);
    save_gradient(ctx, grad, reduction, backend);
    return {loss, grad};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return scaled_backward(ctx, grads, 7, "cross_entropy");
  }
};

std::tuple<Tensor, Tensor> cross_entropy_autograd(const Tensor& logits, const Tensor& labels,
                                                  c10::SymInt ignore_index, double label_smoothing,
                                                  const std::string& reduction, bool with_grad,
                                                  c10::string_view backend) {
  if (!recorded(logits)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kCrossEntropy, SymCrossEntropyForward>().call(
        logits, labels, ignore_index, label_smoothing, reduction, with_grad, backend);
  }
  auto out = CrossEntropy::apply(logits, labels, ignore_index, label_smoothing, reduction,
                                 with_grad, backend);
  return {out[0], out[1]};
}

// --- distillation_loss ------------------------------------------------------------------------

using DistillationForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double,
                                                       const std::string&, bool);
constexpr char kDistillation[] = "fusedlm::distillation_loss";
constexpr char kDistillationForwardKernel[] = "distillation_loss_forward";

struct DistillationLoss : torch::autograd::Function<DistillationLoss> {
  static variable_list forward(AutogradContext* ctx, const Tensor& student, const Tensor& teacher,
                               double temperature, const std::string& reduction, bool with_grad,
                               c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, grad] = dispatched<kDistillation, DistillationForward>().call(
        student, teacher, temperature, reduction, with_grad, backend);
    save_gradient(ctx, grad, reduction, backend);
    return {loss, grad};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return scaled_backward(ctx, grads, 6, "distillation_loss");
  }
};

std::tuple<Tensor, Tensor> distillation_loss_autograd(const Tensor& student, const Tensor& teacher,
                                                      double temperature,
                                                      const std::string& reduction, bool with_grad,
                                                      c10::string_view backend) {
  if (!recorded(student)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kDistillation, DistillationForward>().call(student, teacher, temperature,
                                                                 reduction, with_grad, backend);
  }
  auto out = DistillationLoss::apply(student, teacher, temperature, reduction, with_grad, backend);
  return {out[0], out[1]};
}

// --- masked_lm_loss ---------------------------------------------------------------------------

using MlmOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using MlmGrads = std::tuple<Tensor, Tensor, Tensor>;
using MlmForward = MlmOutputs(const Tensor&, const Tensor&, const OptionalTensor&, const Tensor&,
                              int64_t, double, const std::string&, int64_t, bool, bool, bool);
using MlmBackward = MlmGrads(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                             double, const std::string&, int64_t, bool, bool, bool);
using SymMlmForward = MlmOutputs(const Tensor&, const Tensor&, const OptionalTensor&, const Tensor&,
                                 c10::SymInt, double, const std::string&, c10::SymInt, bool, bool,
                                 bool);
using SymMlmBackward = MlmGrads(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                c10::SymInt, double, const std::string&, c10::SymInt, bool, bool,
                                bool);
constexpr char kMlm[] = "fusedlm::masked_lm_loss";
constexpr char kMlmBackward[] = "fusedlm::masked_lm_loss_backward";
constexpr char kMlmForwardKernel[] = "masked_lm_loss_forward";
constexpr char kMlmBackwardKernel[] = "masked_lm_loss_backward";

struct MaskedLmLoss : torch::autograd::Function<MaskedLmLoss> {
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                               const OptionalTensor& bias, const Tensor& labels,
                               c10::SymInt ignore_index, double label_smoothing,
                               const std::string& reduction, c10::SymInt chunk_rows,
                               bool need_dhidden, bool need_dweight, bool need_dbias,
                               c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, dhidden, dweight, dbias] = dispatched<kMlm, SymMlmForward>().call(
        hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, chunk_rows,
        need_dhidden, need_dweight, need_dbias, backend);
    ctx->save_for_backward({hidden, weight, bias.value_or(Tensor()), labels, dhidden, dweight, dbias});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["chunk_rows"] = chunk_rows;
    ctx->saved_data["needs"] = std::vector<bool>{need_dhidden, need_dweight, need_dbias};
    ctx->saved_data["backend"] = std::string(backend);
    ctx->mark_non_differentiable({dhidden, dweight, dbias});
    ctx->set_materialize_grads(false);
    return {loss, dhidden, dweight, dbias};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(12);
    if (!grads[0].defined()) return out;  // the loss was not used
    const auto s = ctx->get_saved_variables();
    const auto bias = optional(s[2]);
    const c10::SymInt ignore_index = ctx->saved_data["ignore_index"].toSymInt();
    const double label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    const c10::SymInt chunk_rows = ctx->saved_data["chunk_rows"].toSymInt();
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const bool need_dhidden = needs[0], need_dweight = needs[1], need_dbias = needs[2];
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    Tensor dhidden = s[4], dweight = s[5], dbias = s[6];
    if (unit_grad(grads[0], reduction)) {
      // the saved gradients, as they are
    } else if (needs_reference_backward(grads)) {
      const auto taken = reference_backward(
          "masked_lm_loss", backend, 0.0, "masked_lm_loss", grads[0], s[0], s[1], bias, s[3],
          s[4], s[5], s[6], ignore_index, label_smoothing, reduction, chunk_rows, need_dhidden,
          need_dweight, need_dbias);
      dhidden = taken[0], dweight = taken[1], dbias = taken[2];
    } else {
      std::tie(dhidden, dweight, dbias) = dispatched<kMlmBackward, SymMlmBackward>().call(
          grads[0], s[0], s[1], bias, s[3], s[4], s[5], s[6], ignore_index, label_smoothing,
          reduction, chunk_rows, need_dhidden, need_dweight, need_dbias, backend);
    }
    if (need_dhidden) out[0] = dhidden;
    if (need_dweight) out[1] = dweight;
    if (need_dbias) out[2] = dbias;
    return out;
  }
};

MlmOutputs masked_lm_loss_autograd(const Tensor& hidden, const Tensor& weight,
                                   const OptionalTensor& bias, const Tensor& labels,
                                   c10::SymInt ignore_index, double label_smoothing,
                                   const std::string& reduction, c10::SymInt chunk_rows,
                                   bool need_dhidden, bool need_dweight, bool need_dbias,
                                   c10::string_view backend) {
  if (!recorded(hidden, weight, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kMlm, SymMlmForward>().call(hidden, weight, bias, labels, ignore_index,
                                                  label_smoothing, reduction, chunk_rows,
                                                  need_dhidden, need_dweight, need_dbias, backend);
  }
  auto out = MaskedLmLoss::apply(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                 reduction, chunk_rows, need_dhidden, need_dweight, need_dbias,
                                 backend);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("cross_entropy(Tensor logits, Tensor labels, SymInt ignore_index, float label_smoothing, "
        "str reduction, bool with_grad, str backend) -> (Tensor, Tensor)");
  m.def("cross_entropy_backward(Tensor grad, Tensor saved_grad, str reduction, str backend) -> Tensor");
  m.def("distillation_loss(Tensor student_logits, Tensor teacher_logits, float temperature, "
        "str reduction, bool with_grad, str backend) -> (Tensor, Tensor)");
  m.def("masked_lm_loss(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
        "SymInt ignore_index, float label_smoothing, str reduction, SymInt chunk_rows, "
        "bool need_dhidden, bool need_dweight, bool need_dbias, str backend) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("masked_lm_loss_backward(Tensor grad, Tensor hidden, Tensor weight, Tensor? bias, "
        "Tensor labels, Tensor dhidden, Tensor dweight, Tensor dbias, SymInt ignore_index, "
        "float label_smoothing, str reduction, SymInt chunk_rows, bool need_dhidden, "
        "bool need_dweight, bool need_dbias, str backend) -> (Tensor, Tensor, Tensor)");
}

FUSEDLM_ROUTE(cross_entropy, kCrossEntropyForwardKernel, CrossEntropyForward)
FUSEDLM_ROUTE(cross_entropy_backward, kCrossEntropyBackwardKernel, ScaleBackward)
FUSEDLM_ROUTE(distillation_loss, kDistillationForwardKernel, DistillationForward)
FUSEDLM_ROUTE(masked_lm_loss, kMlmForwardKernel, MlmForward)
FUSEDLM_ROUTE(masked_lm_loss_backward, kMlmBackwardKernel, MlmBackward)

TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) {
  m.impl("cross_entropy", &cross_entropy_autograd);
  m.impl("distillation_loss", &distillation_loss_autograd);
  m.impl("masked_lm_loss", &masked_lm_loss_autograd);
}

}  // namespace fusedlm
