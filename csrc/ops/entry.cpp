#include "ops/entry.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <map>
#include <string>

#include "bind.h"

namespace fusedlm {
namespace {

// Filled while the extension loads.
std::map<std::string, PyMethodDef*>& entries() {
  static auto* all = new std::map<std::string, PyMethodDef*>();  // (kept past exit)
  return *all;
}

}  // namespace

bool for_fallback(PyObject* const* args, Py_ssize_t nargs) {
  // (functorch includes its front key while a transform's layer is on its stack)
  if (at::impl::torch_function_mode_enabled() ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    return true;
  }
  static PyObject* const disabled =  // (kept for good)
      pybind11::object(pybind11::module_::import("torch._C").attr("_disabled_torch_function_impl"))
          .release()
          .ptr();
  static PyObject* const name = PyUnicode_InternFromString("__torch_function__");
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (!THPVariable_Check(args[i])) continue;
    if (THPVariable_Unpack(args[i])._fw_grad(/*level=*/0).defined()) return true;
    PyTypeObject* type = Py_TYPE(args[i]);
    if (type == reinterpret_cast<PyTypeObject*>(THPVariableClass)) continue;
    // (the type's attribute cache: a Parameter, a weight, comes with every layer's call)
    PyObject* own = _PyType_Lookup(type, name);  // borrowed, or null without an error
    if (own != nullptr && own != disabled) return true;
  }
  return false;
}

EagerEntry::EagerEntry(const char* name, PyMethodDef* entry) { entries()[name] = entry; }

// The eager entry of op `name`, handing the calls it does not take to `fallback`.
pybind11::object op_entry(const std::string& name, pybind11::object fallback) {
  const auto found = entries().find(name);
  TORCH_CHECK(found != entries().end(), "fusedlm: op ", name, " has no eager entry");
  PyObject* entry = PyCFunction_New(found->second, fallback.ptr());
  if (entry == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(entry);
}
FUSEDLM_BIND(op_entry, pybind11::arg("name"), pybind11::arg("fallback"));

}  // namespace fusedlm
