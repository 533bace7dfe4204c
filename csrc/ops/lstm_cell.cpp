// lstm_cell (fusedlm/ops/lstm_cell.py): its schemas, its kernels' routing and its autograd. Only the
// gate pre-activations and c_prev are saved; the backward recomputes the activations.
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;

using Forward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double);
using Backward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, double);
constexpr char kLstmCell[] = "fusedlm::lstm_cell";
constexpr char kLstmCellBackward[] = "fusedlm::lstm_cell_backward";

struct LstmCellNode : OpNode {
  SavedVariable gates, c_prev;
  double cell_clip = 0.0;

  std::string name() const override { return "fusedlm::LstmCellBackward"; }

  void release_variables() override { release(gates, c_prev); }

  // (grads of h and c) -> (gates, c_prev)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor g = gates.unpack(), c = c_prev.unpack();
    // An output not used has a zero gradient; the kernels read the gradients as rows (a
    // recurrence hands them over as views).
    const Tensor grad_h = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(c);
    const Tensor grad_c = grads[1].defined() ? grads[1].contiguous() : at::zeros_like(c);
    const auto [dgates, dc_prev] = backward_of<kLstmCellBackward, Backward>(
        *this, grads, {"lstm_cell"}, grad_h, grad_c, g, c, cell_clip);
    return {dgates, dc_prev};
  }
};

std::tuple<Tensor, Tensor> lstm_cell_autograd(const Tensor& gates, const Tensor& c_prev,
                                              double cell_clip, c10::string_view backend) {
  auto outputs = below_autograd<kLstmCell, Forward>(gates, c_prev, cell_clip, backend);
  if (!recorded(gates, c_prev)) return outputs;
  auto& [h, c] = outputs;
  auto node = recording_node<LstmCellNode>(gates, c_prev);
  record_outputs(node, h, c);
  node->gates = SavedVariable(gates, false), node->c_prev = SavedVariable(c_prev, false);
  node->cell_clip = cell_clip, node->backend = std::string(backend);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("lstm_cell(Tensor gates, Tensor c_prev, float cell_clip, str backend) -> (Tensor, Tensor)");
  m.def("lstm_cell_backward(Tensor grad_h, Tensor grad_c, Tensor gates, Tensor c_prev, "
        "float cell_clip, str backend) -> (Tensor, Tensor)");
}

FUSEDLM_OP(lstm_cell, Forward, lstm_cell_autograd);
FUSEDLM_BACKWARD_OP(lstm_cell_backward, Backward)

}  // namespace fusedlm
