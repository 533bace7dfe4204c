// How an eager call from Python enters an op: fusedlm._C.op_entry(name, fallback) is a
// function taking the op's arguments, as the OpOverload torch.ops.fusedlm.<name> does, that
// converts them to their C++ types and calls the op through the dispatcher, typed, as torch's
// own Python bindings call theirs. (The OpOverload converts each argument by the schema, at
// run time, which costs an eager call more than the op's kernel does on small tensors.) The
// dispatcher sees the call as it would the OpOverload's: autograd, dispatch modes and fake
// tensors take it alike. The calls the entry does not take go to `fallback`
// (fusedlm.ops._op.Op): those a torch function mode or a tensor's own __torch_function__
// watches, and those under a torch.func transform or carrying forward-mode tangents.
#pragma once
#include <Python.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <utility>

namespace fusedlm {

// Makes `entry` the eager entry of op `name` (unqualified), for op_entry.
struct EagerEntry {
  EagerEntry(const char* name, PyMethodDef* entry);
};

// Whether a call with these arguments is the fallback's: under a torch function mode or a
// torch.func transform, or with a tensor that carries a forward-mode tangent or whose type has
// a __torch_function__ of its own (not a plain tensor, nor a Parameter, whose
// __torch_function__ is torch's disabled one).
bool for_fallback(PyObject* const* args, Py_ssize_t nargs);

template <const char* Name, class Signature>
struct Entry;

// The entry of the op of qualified name Name whose schema has the C++ signature Ret(Args...)
// (its Autograd kernel's, the backend last): a METH_FASTCALL function whose self is the
// fallback.
template <const char* Name, class Ret, class... Args>
struct Entry<Name, Ret(Args...)> {
  static PyObject* call(PyObject* fallback, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    constexpr Py_ssize_t arity = sizeof...(Args);
    if (nargs != arity) {
      return PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", Name, arity, nargs);
    }
    if (for_fallback(args, nargs)) return PyObject_Vectorcall(fallback, args, nargs, nullptr);
    return convert_and_call(args, std::index_sequence_for<Args...>{});
    END_HANDLE_TH_ERRORS
  }

 private:
  template <size_t... I>
  static PyObject* convert_and_call(PyObject* const* args, std::index_sequence<I...>) {
    std::tuple<pybind11::detail::make_caster<Args>...> casters;
    const bool converted[] = {std::get<I>(casters).load(args[I], true)...};
    for (size_t i = 0; i < sizeof...(I); ++i) {
      if (!converted[i]) {
        return PyErr_Format(PyExc_TypeError, "%s: argument %zu has an unexpected type (%s)",
                            Name, i, Py_TYPE(args[i])->tp_name);
      }
    }
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<Ret(Args...)>();
    Ret out = [&] {
      pybind11::gil_scoped_release no_gil;
      return op.call(pybind11::detail::cast_op<Args>(std::get<I>(casters))...);
    }();
    return pybind11::cast(std::move(out)).release().ptr();
  }
};

}  // namespace fusedlm

// Declares the eager entry of op `op` (unqualified; Name, its qualified name, a constexpr
// string), whose schema has the C++ signature Signature, the backend last.
#define FUSEDLM_ENTRY(op, Name, Signature)                                                   \
  static PyMethodDef fusedlm_entry_def_##op = {                                              \
      #op, reinterpret_cast<PyCFunction>(                                                    \
               reinterpret_cast<void (*)(void)>(&::fusedlm::Entry<Name, Signature>::call)),  \
      METH_FASTCALL, nullptr};                                                               \
  static const ::fusedlm::EagerEntry fusedlm_entry_##op(#op, &fusedlm_entry_def_##op)
