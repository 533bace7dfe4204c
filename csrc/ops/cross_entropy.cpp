// cross_entropy, distillation_loss and masked_lm_loss (fusedlm/ops/cross_entropy.py): their
// schemas, their kernels' routing and their autograd. Each forward also returns the gradient
// for grad_output 1 where autograd records the call; the backward scales it by grad_output.
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

using ScaleBackward = Tensor(const Tensor&, const Tensor&, const std::string&);
constexpr char kCrossEntropyBackward[] = "fusedlm::cross_entropy_backward";

// The backward of cross_entropy and distillation_loss: the gradient for grad_output 1, which
// the forward took with the loss and which has no gradient itself, scaled by grad_output.
struct ScaledGradNode : OpNode {
  SavedVariable saved;
  std::string reduction;
  const char* op = "";  // the op the user called
  const char* node_name = "";

  std::string name() const override { return node_name; }

  void release_variables() override { release(saved); }

  // (grad of the loss) -> (the logits')
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor grad = saved.unpack();
    if (unit_grad(grads[0], reduction)) return {grad};
    return {backward_of<kCrossEntropyBackward, ScaleBackward>(
        *this, grads, {"cross_entropy", 0.0, op}, grads[0], grad, reduction)};
  }
};

// Records the loss of a call that took its gradient along (`outputs`: (loss, gradient)).
void record_loss(const Tensor& logits, std::tuple<Tensor, Tensor>& outputs,
                 const std::string& reduction, c10::string_view backend, const char* op,
                 const char* node_name) {
  auto& [loss, grad] = outputs;
  auto node = recording_node<ScaledGradNode>(logits);
  record_outputs(node, loss);
  node->saved = SavedVariable(grad, false);
  node->reduction = reduction, node->op = op, node->node_name = node_name;
  node->backend = std::string(backend);
}

// --- cross_entropy ----------------------------------------------------------------------------

using CrossEntropyForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, double,
                                                       const std::string&, bool);
constexpr char kCrossEntropy[] = "fusedlm::cross_entropy";

std::tuple<Tensor, Tensor> cross_entropy_autograd(const Tensor& logits, const Tensor& labels,
                                                  c10::SymInt ignore_index, double label_smoothing,
                                                  const std::string& reduction, bool with_grad,
                                                  c10::string_view backend) {
  auto outputs = below_autograd<kCrossEntropy, CrossEntropyForward>(
      logits, labels, ignore_index, label_smoothing, reduction, with_grad, backend);
  if (recorded(logits)) record_loss(logits, outputs, reduction, backend, "cross_entropy",
                                      "fusedlm::CrossEntropyBackward");
  return outputs;
}

// --- distillation_loss ------------------------------------------------------------------------

using DistillationForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double,
                                                       const std::string&, bool);
constexpr char kDistillation[] = "fusedlm::distillation_loss";

std::tuple<Tensor, Tensor> distillation_loss_autograd(const Tensor& student, const Tensor& teacher,
                                                      double temperature,
                                                      const std::string& reduction, bool with_grad,
                                                      c10::string_view backend) {
  auto outputs = below_autograd<kDistillation, DistillationForward>(student, teacher, temperature,
                                                                    reduction, with_grad, backend);
  if (recorded(student)) record_loss(student, outputs, reduction, backend, "distillation_loss",
                                       "fusedlm::DistillationLossBackward");
  return outputs;
}

// --- masked_lm_loss ---------------------------------------------------------------------------

using MlmOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using MlmGrads = std::tuple<Tensor, Tensor, Tensor>;
using MlmForward = MlmOutputs(const Tensor&, const Tensor&, const OptionalTensor&, const Tensor&,
                              int64_t, double, const std::string&, int64_t, bool, bool, bool);
using MlmBackward = MlmGrads(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                             double, const std::string&, int64_t, bool, bool, bool);
constexpr char kMlm[] = "fusedlm::masked_lm_loss";
constexpr char kMlmBackward[] = "fusedlm::masked_lm_loss_backward";

struct MaskedLmLossNode : OpNode {
  SavedVariable hidden, weight, bias, labels, dhidden, dweight, dbias;
  c10::SymInt ignore_index, chunk_rows;
  double label_smoothing = 0.0;
  std::string reduction;
  bool need_dhidden = false, need_dweight = false, need_dbias = false;

  std::string name() const override { return "fusedlm::MaskedLmLossBackward"; }

  void release_variables() override {
    release(hidden, weight, bias, labels, dhidden, dweight, dbias);
  }

  // (grad of the loss) -> (hidden, weight, bias)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor h = hidden.unpack(), w = weight.unpack(), y = labels.unpack();
    const auto b = optional(bias.unpack());
    Tensor dh = dhidden.unpack(), dw = dweight.unpack(), db = dbias.unpack();
    // With grad_output 1, the saved gradients as they are.
    if (!unit_grad(grads[0], reduction)) {
      std::tie(dh, dw, db) = backward_of<kMlmBackward, MlmBackward>(
          *this, grads, {"masked_lm_loss"}, grads[0], h, w, b, y, dh, dw, db, ignore_index,
          label_smoothing, reduction, chunk_rows, need_dhidden, need_dweight, need_dbias);
    }
    return {need_dhidden ? dh : Tensor(), need_dweight ? dw : Tensor(), need_dbias ? db : Tensor()};
  }
};

MlmOutputs masked_lm_loss_autograd(const Tensor& hidden, const Tensor& weight,
                                   const OptionalTensor& bias, const Tensor& labels,
                                   c10::SymInt ignore_index, double label_smoothing,
                                   const std::string& reduction, c10::SymInt chunk_rows,
                                   bool need_dhidden, bool need_dweight, bool need_dbias,
                                   c10::string_view backend) {
  auto outputs = below_autograd<kMlm, MlmForward>(hidden, weight, bias, labels, ignore_index,
                                                   label_smoothing, reduction, chunk_rows,
                                                   need_dhidden, need_dweight, need_dbias, backend);
  if (!recorded(hidden, weight, bias)) return outputs;
  auto& [loss, dhidden, dweight, dbias] = outputs;
  auto node = recording_node<MaskedLmLossNode>(hidden, weight, bias);
  record_outputs(node, loss);  // (the gradients it took have none)
  node->hidden = SavedVariable(hidden, false), node->weight = SavedVariable(weight, false);
  if (bias) node->bias = SavedVariable(*bias, false);
  node->labels = SavedVariable(labels, false);
  node->dhidden = SavedVariable(dhidden, false), node->dweight = SavedVariable(dweight, false);
  node->dbias = SavedVariable(dbias, false);
  node->ignore_index = ignore_index, node->chunk_rows = chunk_rows;
  node->label_smoothing = label_smoothing, node->reduction = reduction;
  node->need_dhidden = need_dhidden, node->need_dweight = need_dweight, node->need_dbias = need_dbias;
  node->backend = std::string(backend);
  return outputs;
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

FUSEDLM_OP(cross_entropy, CrossEntropyForward, cross_entropy_autograd);
FUSEDLM_BACKWARD_OP(cross_entropy_backward, ScaleBackward)
FUSEDLM_OP(distillation_loss, DistillationForward, distillation_loss_autograd);
FUSEDLM_OP(masked_lm_loss, MlmForward, masked_lm_loss_autograd);
FUSEDLM_BACKWARD_OP(masked_lm_loss_backward, MlmBackward)

}  // namespace fusedlm
