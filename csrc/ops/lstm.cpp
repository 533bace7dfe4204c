// lstm_cell (fusedlm/ops/lstm.py): its schemas, its kernels' routing and its autograd. Only the
// gate pre-activations and c_prev are saved; the backward recomputes the activations.
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/route.h"

namespace fusedlm {
namespace {

using at::Tensor;

using Forward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double);
using Backward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, double);
constexpr char kLstmCell[] = "fusedlm::lstm_cell";
constexpr char kLstmCellBackward[] = "fusedlm::lstm_cell_backward";
constexpr char kForwardKernel[] = "lstm_cell_forward";
constexpr char kBackwardKernel[] = "lstm_cell_backward";

struct LstmCell : torch::autograd::Function<LstmCell> {
  static variable_list forward(AutogradContext* ctx, const Tensor& gates, const Tensor& c_prev,
                               double cell_clip, c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [h, c] = dispatched<kLstmCell, Forward>().call(gates, c_prev, cell_clip, backend);
    ctx->save_for_backward({gates, c_prev});
    ctx->saved_data["cell_clip"] = cell_clip;
    ctx->saved_data["backend"] = std::string(backend);
    return {h, c};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const double cell_clip = ctx->saved_data["cell_clip"].toDouble();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    // (the kernels read the gradients as rows: a recurrence hands them over as views)
    const Tensor grad_h = grads[0].contiguous(), grad_c = grads[1].contiguous();
    Tensor dgates, dc_prev;
    if (needs_reference_backward(grads)) {
      const auto taken = reference_backward("lstm_cell", backend, 0.0, "lstm_cell", grad_h, grad_c,
                                            s[0], s[1], cell_clip);
      dgates = taken[0], dc_prev = taken[1];
    } else {
      std::tie(dgates, dc_prev) = dispatched<kLstmCellBackward, Backward>().call(
          grad_h, grad_c, s[0], s[1], cell_clip, backend);
    }
    return {dgates, dc_prev, Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> lstm_cell_autograd(const Tensor& gates, const Tensor& c_prev,
                                              double cell_clip, c10::string_view backend) {
  if (!recorded(gates, c_prev)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kLstmCell, Forward>().call(gates, c_prev, cell_clip, backend);
  }
  auto out = LstmCell::apply(gates, c_prev, cell_clip, backend);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("lstm_cell(Tensor gates, Tensor c_prev, float cell_clip, str backend) -> (Tensor, Tensor)");
  m.def("lstm_cell_backward(Tensor grad_h, Tensor grad_c, Tensor gates, Tensor c_prev, "
        "float cell_clip, str backend) -> (Tensor, Tensor)");
}

FUSEDLM_ROUTE(lstm_cell, kForwardKernel, Forward)
FUSEDLM_ROUTE(lstm_cell_backward, kBackwardKernel, Backward)

TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) { m.impl("lstm_cell", &lstm_cell_autograd); }

}  // namespace fusedlm
