// How an entry point reaches Python: FUSEDLM_BIND(name), beside its definition and in its
// namespace, binds it as fusedlm._C.<name> (a CPU entry point, namespace fusedlm) or, from
// namespace fusedlm::cuda, as fusedlm._C.cuda.<name>. Extra arguments go to pybind11's
// def (py::arg names). `name` may also be a constexpr pointer to a function. pyext/module.cpp runs every binding when the module loads.
#pragma once
#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace fusedlm {

struct Binding {
  const char* submodule;  // "" for fusedlm._C itself
  void (*bind)(pybind11::module_&);
};

// Every binding of the extension, added while it is loaded (pyext/module.cpp).
std::vector<Binding>& bindings();

struct Bound {
  Bound(const char* submodule, void (*bind)(pybind11::module_&)) {
    bindings().push_back({submodule, bind});
  }
};

// The submodule of the entry points of the namespace a binding is written in.
inline constexpr const char* kBindingSubmodule = "";
namespace cuda {
inline constexpr const char* kBindingSubmodule = "cuda";
}

}  // namespace fusedlm

#define FUSEDLM_BIND(name, ...)                                                           \
  static const ::fusedlm::Bound fusedlm_bound_##name(                                     \
      kBindingSubmodule, [](pybind11::module_& m) { m.def(#name, name, ##__VA_ARGS__); })
