// How a call of a fusedlm op reaches a backend's kernel. Every op's schema ends in `str backend`
// (the backend fusedlm.backends chose); the op's kernel for the CPU and CUDA dispatch keys is
// Routed<...>::run, which hands the call to that backend's kernel:
//   - a compiled kernel (the cpu backend's, csrc/cpu; the cuda backend's, kernels/cuda), which
//     registers itself beside its Python binding with FUSEDLM_KERNEL(name) (compiled_kernel.h);
//   - else a Python kernel (the triton and reference backends', and a compiled kernel replaced
//     at run time, as the device checks' tests replace one), set by fusedlm.backends through
//     fusedlm._C.set_python_kernel.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <array>
#include <atomic>
#include <string>
#include <tuple>
#include <typeinfo>

#include <torch/library.h>

#include "bind.h"
#include "ops/compiled_kernel.h"

namespace fusedlm {

// fusedlm.backends.BACKEND_NAMES, in order.
constexpr int kBackends = 4;
int backend_index(c10::string_view name);

// One kernel's implementations, by backend: a compiled function (with its type, checked when
// it is called) or a Python callable (kept alive for good: a call may be using it).
struct KernelSlots {
  std::array<void*, kBackends> compiled{};
  std::array<const std::type_info*, kBackends> types{};
  std::array<std::atomic<PyObject*>, kBackends> python{};
};

// The slots of the kernel named `name` ("add_layer_norm_forward"); the reference is stable.
KernelSlots& kernel_slots(const std::string& name);

// Calls `function` with the arguments as Python objects and converts its result.
template <class T>
const T& python_value(const T& value) {
  return value;
}
inline std::string python_value(c10::string_view value) { return std::string(value); }

template <class Ret, class... Args>
Ret call_python(PyObject* function, const Args&... args) {
  pybind11::gil_scoped_acquire gil;
  return pybind11::handle(function)(python_value(args)...).template cast<Ret>();
}

// An output a kernel leaves undefined (a gradient not asked for) as an empty tensor like the
// first tensor argument: an op returns tensors, as the fakes do (fusedlm.backends.filled).
inline void fill(at::Tensor& out, const at::Tensor& like) {
  if (!out.defined()) out = at::empty({0}, like.options());
}
template <class T>
void fill(T&, const at::Tensor&) {}
template <class... Outputs>
void fill(std::tuple<Outputs...>& outs, const at::Tensor& like) {
  std::apply([&](auto&... out) { (fill(out, like), ...); }, outs);
}

template <class... Rest>
const at::Tensor& first_tensor(const at::Tensor& t, const Rest&...) {
  return t;
}
template <class T, class... Rest>
const at::Tensor& first_tensor(const T&, const Rest&... rest) {
  return first_tensor(rest...);
}

template <const char* Name, class Signature>
struct Routed;

// The kernel of op Name for the CPU and CUDA dispatch keys.
template <const char* Name, class Ret, class... Args>
struct Routed<Name, Ret(Args...)> {
  using Function = Ret (*)(Args...);

  static Ret run(Args... args, c10::string_view backend) {
    static KernelSlots& slots = kernel_slots(Name);
    const int b = backend_index(backend);
    if (PyObject* python = slots.python[b].load(std::memory_order_acquire)) {
      return call_python<Ret>(python, args...);
    }
    TORCH_CHECK(slots.compiled[b] != nullptr, "fusedlm: the ", backend, " backend has no ", Name,
                " kernel");
    TORCH_INTERNAL_ASSERT(*slots.types[b] == typeid(Function), Name, " on the ", backend,
                          " backend has another signature than the op's");
    Ret out = reinterpret_cast<Function>(slots.compiled[b])(args...);
    fill(out, first_tensor(args...));
    return out;
  }
};

}  // namespace fusedlm

// Routes op `op` (unqualified) to the kernels named by the constexpr string `kernel_name`, of
// signature Kernel, on CPU and CUDA tensors.
#define FUSEDLM_ROUTE(op, kernel_name, Kernel)                                          \
  TORCH_LIBRARY_IMPL(fusedlm, CPU, m) {                                                  \
    m.impl(#op, &::fusedlm::Routed<kernel_name, Kernel>::run);                           \
  }                                                                                      \
  TORCH_LIBRARY_IMPL(fusedlm, CUDA, m) {                                                 \
    m.impl(#op, &::fusedlm::Routed<kernel_name, Kernel>::run);                           \
  }
