// How an op file (csrc/ops/<op file>.cpp) registers its ops, once their schemas are defined
// (TORCH_LIBRARY_FRAGMENT):
//   FUSEDLM_OP(op, Kernel, autograd): op `op`, whose kernels (`<op>_forward` on each backend)
//     have the signature Kernel and whose Autograd kernel is the function `autograd`: its
//     routing on CPU and CUDA tensors (route.h), its autograd, and its entry for eager calls
//     from Python (entry.h);
//   FUSEDLM_BACKWARD_OP(op, Kernel): the backward op `op`, whose kernels have its name and the
//     signature Kernel: its routing, and its Autograd kernel, which runs it below autograd
//     (autograd.h).
#pragma once
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/entry.h"
#include "ops/route.h"

#define FUSEDLM_OP(op, Kernel, autograd)                                                    \
  namespace fusedlm_op_##op {                                                               \
  constexpr char kName[] = "fusedlm::" #op;                                                 \
  constexpr char kKernel[] = #op "_forward";                                                \
  }                                                                                         \
  FUSEDLM_ROUTE(op, fusedlm_op_##op::kKernel, Kernel)                                       \
  TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) { m.impl(#op, &autograd); }                      \
  FUSEDLM_ENTRY(op, fusedlm_op_##op::kName, decltype(autograd))

#define FUSEDLM_BACKWARD_OP(op, Kernel)                                                     \
  namespace fusedlm_op_##op {                                                               \
  constexpr char kName[] = "fusedlm::" #op;                                                 \
  constexpr char kKernel[] = #op;                                                           \
  }                                                                                         \
  FUSEDLM_ROUTE(op, fusedlm_op_##op::kKernel, Kernel)                                       \
  TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) {                                                \
    m.impl(#op, &::fusedlm::BelowAutograd<fusedlm_op_##op::kName, Kernel>::run);            \
  }
