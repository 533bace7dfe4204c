// How a backend's compiled kernel of an op (csrc/cpu/<op>.cpp, kernels/cuda/<op>.cu) makes
// itself known: FUSEDLM_KERNEL(name) beside its definition, in the backend's namespace, binds
// it as fusedlm._C[.cuda].<name> (FUSEDLM_BIND) and registers it as that backend's kernel of
// that name, which the ops' routing calls (route.h).
#pragma once
#include <typeinfo>

#include "bind.h"

namespace fusedlm {

struct CompiledKernel {
  CompiledKernel(const char* name, const char* backend, void* function, const std::type_info& type);
};

template <class F>
F* as_function(F* f) {
  return f;
}

// The backend whose compiled kernels a namespace holds.
inline constexpr const char* kKernelBackend = "cpu";
namespace cuda {
inline constexpr const char* kKernelBackend = "cuda";
}

}  // namespace fusedlm

// `name` is a function or a constexpr pointer to one.
#define FUSEDLM_KERNEL(name)                                                              \
  FUSEDLM_BIND(name);                                                                     \
  static const ::fusedlm::CompiledKernel fusedlm_kernel_##name(                           \
      #name, kKernelBackend, reinterpret_cast<void*>(::fusedlm::as_function(name)),       \
      typeid(::fusedlm::as_function(name)))
