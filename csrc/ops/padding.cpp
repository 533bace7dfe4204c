// unpad and pad (fusedlm/ops/padding.py): their schemas, their kernels' routing and their
// autograd. Each is the other's backward: unpad's gradient is pad, and pad's is a gather
// (pad_backward).
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;

// --- pad --------------------------------------------------------------------------------------

using PadForward = Tensor(const Tensor&, const Tensor&, int64_t, int64_t);
using PadBackward = Tensor(const Tensor&, const Tensor&);
constexpr char kPad[] = "fusedlm::pad";
constexpr char kPadBackward[] = "fusedlm::pad_backward";

struct PadNode : OpNode {
  SavedVariable indices;

  std::string name() const override { return "fusedlm::PadBackward"; }

  void release_variables() override { release(indices); }

  // (grad of the padded tensor) -> (packed)'s: its rows at indices.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor rows = indices.unpack();
    return {backward_of<kPadBackward, PadBackward>(*this, grads, {"pad"}, grads[0], rows)};
  }
};

Tensor pad_autograd(const Tensor& packed, const Tensor& indices, c10::SymInt batch,
                    c10::SymInt seqlen, c10::string_view backend) {
  auto out = below_autograd<kPad, PadForward>(packed, indices, batch, seqlen, backend);
  if (!recorded(packed)) return out;
  auto node = recording_node<PadNode>(packed);
  record_outputs(node, out);
  node->indices = SavedVariable(indices, false), node->backend = std::string(backend);
  return out;
}

// --- unpad ------------------------------------------------------------------------------------

using UnpadOutputs = std::tuple<Tensor, Tensor, Tensor, int64_t>;
using UnpadForward = UnpadOutputs(const Tensor&, const Tensor&);
using SymUnpadForward = std::tuple<Tensor, Tensor, Tensor, c10::SymInt>(const Tensor&, const Tensor&);
constexpr char kUnpad[] = "fusedlm::unpad";
constexpr char kUnpadForwardKernel[] = "unpad_forward";

// unpad's gradient is pad: the packed rows' gradients back in their padded places.
struct UnpadNode : OpNode {
  SavedVariable indices;
  c10::SymInt batch, seqlen;

  std::string name() const override { return "fusedlm::UnpadBackward"; }

  void release_variables() override { release(indices); }

  // (grad of packed) -> (hidden)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor rows = indices.unpack();
    return {backward_of<kPad, PadForward>(*this, grads, {"unpad"}, grads[0], rows, batch, seqlen)};
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
  auto outputs = below_autograd<kUnpad, SymUnpadForward>(hidden, mask, backend);
  if (!recorded(hidden)) return outputs;
  auto& packed = std::get<0>(outputs);
  auto node = recording_node<UnpadNode>(hidden);
  record_outputs(node, packed);  // (indices and cu_seqlens have no gradient)
  node->indices = SavedVariable(std::get<1>(outputs), false);
  node->batch = hidden.sym_size(0), node->seqlen = hidden.sym_size(1);
  node->backend = std::string(backend);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("unpad(Tensor hidden, Tensor key_padding_mask, str backend) -> (Tensor, Tensor, Tensor, SymInt)");
  m.def("pad(Tensor packed, Tensor indices, SymInt batch, SymInt seqlen, str backend) -> Tensor");
  m.def("pad_backward(Tensor grad, Tensor indices, str backend) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusedlm, CPU, m) { m.impl("unpad", &unpad_kernel); }
TORCH_LIBRARY_IMPL(fusedlm, CUDA, m) { m.impl("unpad", &unpad_kernel); }
TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) { m.impl("unpad", &unpad_autograd); }
FUSEDLM_ENTRY(unpad, kUnpad, decltype(unpad_autograd));
FUSEDLM_OP(pad, PadForward, pad_autograd);
FUSEDLM_BACKWARD_OP(pad_backward, PadBackward)

}  // namespace fusedlm
