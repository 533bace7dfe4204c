// unpad and pad (fusedlm/ops/padding.py): their schemas, their kernels' routing and their
// autograd. Each is the other's backward: unpad's gradient is pad, and pad's is a gather
// (pad_backward).
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/route.h"

namespace fusedlm {
namespace {

using at::Tensor;

// --- pad --------------------------------------------------------------------------------------

using PadForward = Tensor(const Tensor&, const Tensor&, int64_t, int64_t);
using SymPadForward = Tensor(const Tensor&, const Tensor&, c10::SymInt, c10::SymInt);
using PadBackward = Tensor(const Tensor&, const Tensor&);
constexpr char kPad[] = "fusedlm::pad";
constexpr char kPadBackward[] = "fusedlm::pad_backward";
constexpr char kPadForwardKernel[] = "pad_forward";
constexpr char kPadBackwardKernel[] = "pad_backward";

struct Pad : torch::autograd::Function<Pad> {
  static Tensor forward(AutogradContext* ctx, const Tensor& packed, const Tensor& indices,
                        c10::SymInt batch, c10::SymInt seqlen, c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({indices});
    ctx->saved_data["backend"] = std::string(backend);
    return dispatched<kPad, SymPadForward>().call(packed, indices, batch, seqlen, backend);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor indices = ctx->get_saved_variables()[0];
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    const Tensor dpacked =
        needs_reference_backward(grads)
            ? reference_backward("pad", backend, 0.0, "pad", grads[0], indices)[0]
            : dispatched<kPadBackward, PadBackward>().call(grads[0], indices, backend);
    return {dpacked, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor pad_autograd(const Tensor& packed, const Tensor& indices, c10::SymInt batch,
                    c10::SymInt seqlen, c10::string_view backend) {
  if (!recorded(packed)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kPad, SymPadForward>().call(packed, indices, batch, seqlen, backend);
  }
  return Pad::apply(packed, indices, batch, seqlen, backend);
}

// --- unpad ------------------------------------------------------------------------------------

using UnpadOutputs = std::tuple<Tensor, Tensor, Tensor, int64_t>;
using UnpadForward = UnpadOutputs(const Tensor&, const Tensor&);
using SymUnpadForward = std::tuple<Tensor, Tensor, Tensor, c10::SymInt>(const Tensor&, const Tensor&);
constexpr char kUnpad[] = "fusedlm::unpad";
constexpr char kUnpadForwardKernel[] = "unpad_forward";

// Records the packed rows' gradient; the longest length, not a tensor, leaves through
// `max_seqlen`.
struct Unpad : torch::autograd::Function<Unpad> {
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& mask,
                               c10::string_view backend, c10::SymInt* max_seqlen) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [packed, indices, cu_seqlens, longest] =
        dispatched<kUnpad, SymUnpadForward>().call(hidden, mask, backend);
    *max_seqlen = longest;
    ctx->save_for_backward({indices});
    ctx->saved_data["batch"] = hidden.sym_size(0);
    ctx->saved_data["seqlen"] = hidden.sym_size(1);
    ctx->saved_data["backend"] = std::string(backend);
    ctx->mark_non_differentiable({indices, cu_seqlens});
    return {packed, indices, cu_seqlens};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor indices = ctx->get_saved_variables()[0];
    const c10::SymInt batch = ctx->saved_data["batch"].toSymInt();
    const c10::SymInt seqlen = ctx->saved_data["seqlen"].toSymInt();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    const Tensor dhidden =
        needs_reference_backward(grads)
            ? reference_backward("unpad", backend, 0.0, "unpad", grads[0], indices, batch, seqlen)[0]
            : dispatched<kPad, SymPadForward>().call(grads[0], indices, batch, seqlen, backend);
    return {dhidden, Tensor(), Tensor(), Tensor()};
  }
};

// The schema returns the longest length as a SymInt (unbacked under torch.compile); the
// kernels, as an int.
std::tuple<Tensor, Tensor, Tensor, c10::SymInt> unpad_kernel(const Tensor& hidden,
                                                             const Tensor& mask,
                                                             c10::string_view backend) {
  auto [packed, indices, cu_seqlens, longest] =
      Routed<kUnpadForwardKernel, UnpadForward>::run(hidden, mask, backend);
  return {packed, indices, cu_seqlens, c10::SymInt(longest)};
}

std::tuple<Tensor, Tensor, Tensor, c10::SymInt> unpad_autograd(const Tensor& hidden,
                                                               const Tensor& mask,
                                                               c10::string_view backend) {
  if (!recorded(hidden)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kUnpad, SymUnpadForward>().call(hidden, mask, backend);
  }
  c10::SymInt max_seqlen;
  auto out = Unpad::apply(hidden, mask, backend, &max_seqlen);
  return {out[0], out[1], out[2], max_seqlen};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("unpad(Tensor hidden, Tensor key_padding_mask, str backend) -> (Tensor, Tensor, Tensor, SymInt)");
  m.def("pad(Tensor packed, Tensor indices, SymInt batch, SymInt seqlen, str backend) -> Tensor");
  m.def("pad_backward(Tensor grad, Tensor indices, str backend) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusedlm, CPU, m) { m.impl("unpad", &unpad_kernel); }
TORCH_LIBRARY_IMPL(fusedlm, CUDA, m) { m.impl("unpad", &unpad_kernel); }
FUSEDLM_ROUTE(pad, kPadForwardKernel, PadForward)
FUSEDLM_ROUTE(pad_backward, kPadBackwardKernel, PadBackward)

TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) {
  m.impl("unpad", &unpad_autograd);
  m.impl("pad", &pad_autograd);
}

}  // namespace fusedlm
