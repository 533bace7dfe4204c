// bias_gelu and gelu_ffn (fusedlm/ops/gelu.py): their schemas, their kernels' routing and their
// autograd.
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// --- bias_gelu --------------------------------------------------------------------------------

using BiasGeluForward = Tensor(const Tensor&, const OptionalTensor&, const std::string&);
using BiasGeluBackward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                    const OptionalTensor&, const std::string&);
constexpr char kBiasGelu[] = "fusedlm::bias_gelu";
constexpr char kBiasGeluBackward[] = "fusedlm::bias_gelu_backward";

// Saves x and bias; the backward recomputes the activation's slope.
struct BiasGeluNode : OpNode {
  SavedVariable x, bias;
  std::string approximate;

  std::string name() const override { return "fusedlm::BiasGeluBackward"; }

  void release_variables() override { release(x, bias); }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor input = x.unpack();
    const auto b = optional(bias.unpack());
    const auto [dx, dbias] = backward_of<kBiasGeluBackward, BiasGeluBackward>(
        *this, grads, {"bias_gelu"}, grads[0], input, b, approximate);
    return {dx, b ? dbias : Tensor()};
  }
};

Tensor bias_gelu_autograd(const Tensor& x, const OptionalTensor& bias, const std::string& approximate,
                          c10::string_view backend) {
  auto out = below_autograd<kBiasGelu, BiasGeluForward>(x, bias, approximate, backend);
  if (!recorded(x, bias)) return out;
  auto node = recording_node<BiasGeluNode>(x, bias);
  record_outputs(node, out);
  node->x = SavedVariable(x, false);
  if (bias) node->bias = SavedVariable(*bias, false);
  node->approximate = approximate, node->backend = std::string(backend);
  return out;
}

// --- gelu_ffn ---------------------------------------------------------------------------------

using GeluFfnForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptionalTensor&,
                                                  const Tensor&, const OptionalTensor&,
                                                  const std::string&, double, const Tensor&);
using GeluFfnBackward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
    const Tensor&, const OptionalTensor&, const std::string&, double, const Tensor&);
constexpr char kGeluFfn[] = "fusedlm::gelu_ffn";
constexpr char kGeluFfnBackward[] = "fusedlm::gelu_ffn_backward";

// Saves the pre-activation (the second output) rather than the activation, which the backward
// recomputes; the dropout mask is regenerated from its seed.
struct GeluFfnNode : OpNode {
  SavedVariable x, pre, w1, b1, w2, b2, seed;
  std::string approximate;
  double dropout_p = 0.0;

  std::string name() const override { return "fusedlm::GeluFfnBackward"; }

  void release_variables() override { release(x, pre, w1, b1, w2, b2, seed); }

  // (grad of the output) -> (x, w1, b1, w2, b2)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor input = x.unpack(), p = pre.unpack(), first = w1.unpack(), second = w2.unpack();
    const Tensor sd = seed.unpack();
    const auto bias1 = optional(b1.unpack()), bias2 = optional(b2.unpack());
    const auto [dx, dw1, db1, dw2, db2] = backward_of<kGeluFfnBackward, GeluFfnBackward>(
        *this, grads, {"gelu_ffn", dropout_p}, grads[0], input, p, first, bias1, second, bias2,
        approximate, dropout_p, sd);
    return {dx, dw1, bias1 ? db1 : Tensor(), dw2, bias2 ? db2 : Tensor()};
  }
};

std::tuple<Tensor, Tensor> gelu_ffn_autograd(const Tensor& x, const Tensor& w1,
                                             const OptionalTensor& b1, const Tensor& w2,
                                             const OptionalTensor& b2, const std::string& approximate,
                                             double dropout_p, const Tensor& seed,
                                             c10::string_view backend) {
  auto outputs = below_autograd<kGeluFfn, GeluFfnForward>(x, w1, b1, w2, b2, approximate,
                                                          dropout_p, seed, backend);
  if (!recorded(x, w1, b1, w2, b2)) return outputs;
  auto& [out, pre] = outputs;
  auto node = recording_node<GeluFfnNode>(x, w1, b1, w2, b2);
  record_outputs(node, out);  // (the pre-activation has no gradient)
  node->x = SavedVariable(x, false), node->pre = SavedVariable(pre, false);
  node->w1 = SavedVariable(w1, false), node->w2 = SavedVariable(w2, false);
  if (b1) node->b1 = SavedVariable(*b1, false);
  if (b2) node->b2 = SavedVariable(*b2, false);
  node->seed = SavedVariable(seed, false);
  node->approximate = approximate, node->dropout_p = dropout_p, node->backend = std::string(backend);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("bias_gelu(Tensor x, Tensor? bias, str approximate, str backend) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor? bias, str approximate, str backend) "
        "-> (Tensor, Tensor)");
  m.def("gelu_ffn(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str approximate, "
        "float dropout_p, Tensor seed, str backend) -> (Tensor, Tensor)");
  m.def("gelu_ffn_backward(Tensor grad, Tensor x, Tensor pre, Tensor w1, Tensor? b1, Tensor w2, "
        "Tensor? b2, str approximate, float dropout_p, Tensor seed, str backend) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

FUSEDLM_OP(bias_gelu, BiasGeluForward, bias_gelu_autograd);
FUSEDLM_BACKWARD_OP(bias_gelu_backward, BiasGeluBackward)
FUSEDLM_OP(gelu_ffn, GeluFfnForward, gelu_ffn_autograd);
FUSEDLM_BACKWARD_OP(gelu_ffn_backward, GeluFfnBackward)

}  // namespace fusedlm
