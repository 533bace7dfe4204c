// What the ops' autograd (csrc/ops/<op>.cpp, for the Autograd dispatch key) shares. Each op
// follows torch's own ops: its forward calls the op below autograd and records a node of its
// own, a torch::autograd::Node holding what the backward needs as members, as torch's
// generated nodes do (cheaper than torch::autograd::Function's saved-data map, per-call
// metadata and name demangling); the node's backward calls the backward op through the
// dispatcher, so that torch.compile traces both as ops.
#pragma once
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fusedlm {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// What points to a node: torch 2.13 counts a node's references intrusively, 2.11 with a
// shared_ptr.
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());

// The base of an op's backward node, which holds the backend the forward ran on. (Its
// backward takes Node::mutex_ while it reads the saved tensors, as torch's nodes do.)
struct OpNode : torch::autograd::Node {
  std::string backend;

 protected:
  // Drops the data of the saved tensors, under the node's lock: what a node's
  // release_variables does, once autograd will not run its backward again.
  template <class... Saved>
  void release(Saved&... saved) {
    std::lock_guard<std::mutex> lock(mutex_);
    (saved.reset_data(), ...);
  }
};

// A new node of type N whose next edges are those of `inputs` (tensors, or optional ones: an
// absent one has an empty edge), in their order, which is the order of the gradients its
// backward returns.
template <class N, class... Inputs>
auto recording_node(const Inputs&... inputs) {
  using Base = torch::autograd::Node;
  auto node = [] {
    if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Base>) {
      return c10::make_intrusive<N>();
    } else {  // (deleteNode frees long chains of nodes without recursing)
      return std::shared_ptr<N>(new N(), [](N* n) { deleteNode(n); });
    }
  }();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  return node;
}

// Whether none of a node's output gradients is defined (every output unused, as gradcheck
// also asks): its inputs then get none either.
inline bool no_gradient(const variable_list& grads) {
  for (const auto& grad : grads)
    if (grad.defined()) return false;
  return true;
}

// Makes `node` the gradient function of `outputs`, in order: its backward receives their
// gradients (undefined where an output was not used).
template <class N, class... Outputs>
void record_outputs(const N& node, Outputs&... outputs) {
  const NodePtr base = node;
  (torch::autograd::set_history(outputs, base), ...);
}

// An argument's type in an op's schema, from its kernels' type: every integer is a SymInt
// (symbolic under torch.compile, as a maximum length unpad returns), the rest as they are.
template <class T>
struct SchemaArg {
  using type = T;
};
template <>
struct SchemaArg<int64_t> {
  using type = c10::SymInt;
};

// An op's signature from its kernels' (Kernel): the same arguments as the schema types them,
// then the backend.
template <class Kernel>
struct WithBackend;
template <class Ret, class... Args>
struct WithBackend<Ret(Args...)> {
  using type = Ret(typename SchemaArg<Args>::type..., c10::string_view);
};

// The op of qualified name Name ("fusedlm::add_layer_norm"), whose kernels have the signature
// Kernel, typed, to call through the dispatcher: dispatched<kOp, Forward>().call(..., backend)
// (looked up once).
template <const char* Name, class Kernel>
const c10::TypedOperatorHandle<typename WithBackend<Kernel>::type>& dispatched() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(Name, "")
                             .template typed<typename WithBackend<Kernel>::type>();
  return op;
}

// Op Name, whose kernels have the signature Kernel, called below autograd, on its kernel for
// the tensors' device (`args`: the schema's, the backend last): what an op's Autograd kernel
// runs first, and all it runs for a call autograd does not record.
template <const char* Name, class Kernel, class... Args>
auto below_autograd(const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView below;
  return dispatched<Name, Kernel>().call(args...);
}

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) { return t && requires_grad(*t); }
template <class T>
bool requires_grad(const T&) {
  return false;
}

// Whether autograd records a call with these arguments; one it does not runs below autograd
// without a node.
template <class... Args>
bool recorded(const Args&... args) {
  return at::GradMode::is_enabled() && (requires_grad(args) || ...);
}

// The Autograd kernel of a backward op (fusedlm::<op>_backward, named Name, whose kernels have
// the signature Kernel), which autograd never records: a node's backward calls it with grad
// mode off, and a gradient to be differentiated again is the reference backward's. It runs the
// op below autograd, without the boxed fallback torch runs for an op with no Autograd kernel;
// a call autograd would record raises.
template <const char* Name, class Kernel>
struct BelowAutograd;
template <const char* Name, class Ret, class... Args>
struct BelowAutograd<Name, Ret(Args...)> {
  static Ret run(typename SchemaArg<Args>::type... args, c10::string_view backend) {
    TORCH_CHECK(!recorded(args...), Name, " has no derivative: a gradient to be differentiated "
                "again is fusedlm's reference backward (fusedlm.ops._op.reference_backward)");
    return below_autograd<Name, Ret(Args...)>(args..., backend);
  }
};

inline std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Whether the backward being run, of these output gradients, is one the backend's kernel
// cannot serve: a gradient to be differentiated again (create_graph=True), which the kernel
// would not record, or one taken under a torch.func transform or autograd's own vmap
// (is_grads_batched), whose wrapped tensors no kernel reads.
inline bool needs_reference_backward(const variable_list& grads) {
  if (at::GradMode::is_enabled() ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    return true;
  }
  for (const auto& grad : grads)
    if (grad.defined() && at::isBatchedTensor(grad)) return true;
  return false;
}

// The gradients (undefined where None) of op's reference backward,
// fusedlm.ops._op.reference_backward: plain PyTorch that autograd records and transforms take.
// `backend` and `dropout_p` are the forward's; raises what Python raises.
template <class... Args>
variable_list reference_backward(const char* op, const std::string& backend, double dropout_p,
                                 const char* caller, Args&&... args) {
  pybind11::gil_scoped_acquire gil;
  const auto grads = pybind11::module_::import("fusedlm.ops._op")
                         .attr("reference_backward")(op, backend, dropout_p,
                                                     std::forward<Args>(args)...,
                                                     pybind11::arg("caller") = caller);
  variable_list out;
  for (const auto grad : grads)
    out.push_back(grad.is_none() ? at::Tensor() : pybind11::cast<at::Tensor>(grad));
  return out;
}

// A list of gradients as a kernel returns them: one tensor, or a tuple of them.
template <class Ret>
struct FromList {
  static Ret get(const variable_list& grads) { return grads.at(0); }
};
template <class... T>
struct FromList<std::tuple<T...>> {
  static std::tuple<T...> get(const variable_list& grads) {
    return take(grads, std::index_sequence_for<T...>{});
  }
  template <size_t... I>
  static std::tuple<T...> take(const variable_list& grads, std::index_sequence<I...>) {
    return {grads.at(I)...};
  }
};

// Whose reference backward stands in for a node's kernel: the op's (`op`), given the
// forward's dropout_p, and the op the user called where it borrows `op`'s backward.
struct Reference {
  const char* op;
  double dropout_p = 0.0;
  const char* caller = nullptr;
};

// The gradients of a node's backward, as the kernels of backward op Name (of signature
// Kernel) return them, from the kernel's arguments `args`: that kernel on the forward's
// backend or, for output gradients it cannot serve (needs_reference_backward), the
// reference backward.
template <const char* Name, class Kernel, class... Args>
auto backward_of(const OpNode& node, const variable_list& grads, const Reference& reference,
                 const Args&... args) {
  using Ret = decltype(dispatched<Name, Kernel>().call(args..., node.backend));
  if (needs_reference_backward(grads)) {
    return FromList<Ret>::get(reference_backward(reference.op, node.backend, reference.dropout_p,
                                                 reference.caller ? reference.caller : reference.op,
                                                 args...));
  }
  return dispatched<Name, Kernel>().call(args..., node.backend);
}

// Whether a loss's backward may hand out the gradients its forward saved as they are:
// grad_output is exactly 1 (loss.backward()), on the CPU (reading it elsewhere would
// synchronise), a plain tensor (a traced one has no value to read), the gradient is not to be
// differentiated again or batched, and the loss is reduced. The saved gradients then become
// the inputs' without a copy: without retain_graph autograd has released them, and with it
// .grad accumulation copies them and an in-place change bumps their version, so a second
// backward raises instead of reading it.
inline bool unit_grad(const at::Tensor& grad, c10::string_view reduction) {
  constexpr auto traced = c10::DispatchKeySet({c10::DispatchKey::Python,
                                                c10::DispatchKey::Functionalize});
  return reduction != "none" && grad.device().is_cpu() && !grad.key_set().has_any(traced) &&
         !needs_reference_backward({grad}) && grad.item<double>() == 1.0;
}

}  // namespace fusedlm
