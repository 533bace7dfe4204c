// fusedlm._C.call_key: the key under which fusedlm.backends.planner memoises a planner's
// answer (its checks passed and the backend chosen), read on every eager call, so in C++.
//
// A planner reads its arguments' types and values, its tensors' metadata and the grad mode,
// nothing else of a call (what it reads of the data, the index tensors' values, it marks as
// unsettled and is not memoised). The key holds exactly that: equal keys, equal answers.
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <string>

#include "bind.h"

namespace fusedlm {
namespace {

namespace py = pybind11;

template <class T>
void put(std::string& key, T value) {
  key.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// A tensor's dtype, device, layout, autograd flag, sizes and strides; false for what a key
// cannot hold exactly: a subclass (its methods may answer anything), nested or sparse tensors
// and symbolic sizes.
bool put_tensor(std::string& key, PyObject* obj) {
  static PyObject* parameter =
      py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
      Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(parameter)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.is_nested() || t.layout() != at::kStrided ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  key.push_back(Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(parameter) ? 'P' : 'T');
  put(key, static_cast<int8_t>(t.scalar_type()));
  put(key, static_cast<int8_t>(t.device().type()));
  put(key, static_cast<int8_t>(t.device().index()));
  put(key, static_cast<int8_t>(t.requires_grad()));
  put(key, static_cast<int8_t>(t.dim()));
  for (int64_t size : t.sizes()) put(key, size);
  for (int64_t stride : t.strides()) put(key, stride);
  return true;
}

// One argument: its type and value (a tensor's metadata). false where it is of another kind.
bool put_value(std::string& key, PyObject* obj, int depth) {
  if (obj == Py_None) {
    key.push_back('n');
  } else if (PyBool_Check(obj)) {  // (before int: bool is one, and a planner tells them apart)
    key.push_back(obj == Py_True ? 'Y' : 'N');
  } else if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow) return false;
    key.push_back('i');
    put(key, static_cast<int64_t>(value));
  } else if (PyFloat_CheckExact(obj)) {
    key.push_back('f');
    put(key, PyFloat_AS_DOUBLE(obj));
  } else if (PyUnicode_CheckExact(obj)) {
    Py_ssize_t size = 0;
    const char* text = PyUnicode_AsUTF8AndSize(obj, &size);
    if (text == nullptr) {
      PyErr_Clear();
      return false;
    }
    key.push_back('s');
    put(key, static_cast<int64_t>(size));
    key.append(text, size);
  } else if (THPVariable_Check(obj)) {
    return put_tensor(key, obj);
  } else if ((PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) && depth < 2) {
    const bool tuple = PyTuple_CheckExact(obj);
    const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(obj) : PyList_GET_SIZE(obj);
    key.push_back(tuple ? '(' : '[');
    put(key, static_cast<int64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!put_value(key, tuple ? PyTuple_GET_ITEM(obj, i) : PyList_GET_ITEM(obj, i), depth + 1))
        return false;
    }
  } else {
    return false;
  }
  return true;
}

// call_key(args, kwargs, forcing): bytes, or None where an argument is of a kind the key cannot
// hold (the call is then planned afresh). `forcing` (a value of the kinds above) joins the key:
// the backend calls are forced to and what forced it. A fast-call function: it runs on every
// eager call.
PyObject* call_key(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[0]) || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "call_key takes (args: tuple, kwargs: dict, forcing)");
    return nullptr;
  }
  std::string key;
  key.reserve(256);
  key.push_back(torch::autograd::GradMode::is_enabled() ? 'G' : 'g');
  if (!put_value(key, args[2], 0)) Py_RETURN_NONE;
  for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(args[0]); i < n; ++i) {
    if (!put_value(key, PyTuple_GET_ITEM(args[0], i), 0)) Py_RETURN_NONE;
  }
  PyObject *name = nullptr, *value = nullptr;
  for (Py_ssize_t position = 0; PyDict_Next(args[1], &position, &name, &value);) {
    if (!put_value(key, name, 0) || !put_value(key, value, 0)) Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

PyMethodDef call_key_def = {"call_key", reinterpret_cast<PyCFunction>(
                                            reinterpret_cast<void (*)(void)>(&call_key)),
                            METH_FASTCALL, "call_key(args, kwargs, forcing) -> bytes or None"};
const Bound bound_call_key(kBindingSubmodule, [](py::module_& m) {
  m.add_object("call_key", py::reinterpret_steal<py::object>(PyCFunction_New(&call_key_def, nullptr)));
});

}  // namespace
}  // namespace fusedlm
