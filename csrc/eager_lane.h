// An op's eager lane on the CPU: its whole call from Python, from the argument checks to
// the autograd node, in one C++ call (fusedlm.backends.Kernel.eager). fusedlm/ops calls
// it first once dispatch has settled on the cpu backend for the call's dtype; it returns
// None for every call it does not take whole (an argument out of the ordinary, a dtype not
// settled, anything but autograd watching), and the Python path, with its checks and
// their messages, runs those. The lane takes only calls that path accepts, and gives the
// outputs that path gives, bit for bit (tests/test_eager_lane.py). On a cache the op's
// data has just gone through, the Python path's dozen calls cost about 25 µs: 5% of
// add_layer_norm at BERT-base sizes.
#pragma once
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>
#include <string>

namespace fusedlm::eager {

// The tensor `arg` holds where it is a torch.Tensor or Parameter (no other subclass), dense,
// on the CPU and without a Python dispatch key; else null.
inline const at::Tensor* cpu_tensor(pybind11::handle arg) {
  if (!THPVariable_CheckExact(arg.ptr())) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(arg.ptr());
  if (!t.is_cpu() || t.layout() != at::kStrided || t.key_set().has(c10::DispatchKey::Python)) {
    return nullptr;
  }
  return &t;
}

// Whether `t`'s dtype is in the Python set `dtypes` (those dispatch has settled).
inline bool settled(pybind11::handle dtypes, const at::Tensor& t) {
  return PySet_Contains(dtypes.ptr(), reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()))) == 1;
}

// What fusedlm.backends.unobserved() tells, but torch.compile's tracing (the Python side
// asks that first): no dispatch mode, jit tracing or torch.func transform (functorch
// includes its front-mode key for this thread while its interpreter stack is not empty).
inline bool unobserved() {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !torch::jit::tracer::isTracing() &&
         !c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

// The value of `arg` where it is a Python float (exactly: not a bool, int or subclass) in
// [low, high); else nullopt.
inline std::optional<double> float_in(pybind11::handle arg, double low, double high) {
  if (!PyFloat_CheckExact(arg.ptr())) return std::nullopt;
  const double value = PyFloat_AS_DOUBLE(arg.ptr());
  if (!(value >= low && value < high)) return std::nullopt;  // (NaN fails both)
  return value;
}

// The value of `arg` where it is a Python str equal to one of `choices`; else nullopt.
inline std::optional<std::string> one_of(pybind11::handle arg, std::initializer_list<const char*> choices) {
  if (!PyUnicode_CheckExact(arg.ptr())) return std::nullopt;
  const char* value = PyUnicode_AsUTF8(arg.ptr());
  if (value == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  for (const char* choice : choices) {
    if (std::string_view(value) == choice) return std::string(value);
  }
  return std::nullopt;
}

// A dropout seed as fusedlm.ops._dropout.next_seed draws it: from torch's default generator,
// the same draw; one constant tensor without dropout.
inline at::Tensor next_seed(double p) {
  static const at::Tensor& no_dropout = *new at::Tensor(at::zeros({}, at::kLong));  // (never freed: kept past exit)
  return p > 0 ? at::randint(0, int64_t(1) << 62, {}, at::kLong) : no_dropout;
}

}  // namespace fusedlm::eager
