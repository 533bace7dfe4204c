// Fills this instruction set's KernelTable (see kernels.h).
#include "math.h"

namespace fusedlm::cpu {
namespace FUSEDLM_ISA {
#define FUSEDLM_DECLARE_KERNEL(name) name##_fn name;
FUSEDLM_CPU_KERNELS(FUSEDLM_DECLARE_KERNEL)
#undef FUSEDLM_DECLARE_KERNEL
}  // namespace FUSEDLM_ISA

#define FUSEDLM_STR2(x) #x
#define FUSEDLM_STR(x) FUSEDLM_STR2(x)
#define FUSEDLM_CAT2(a, b) a##b
#define FUSEDLM_CAT(a, b) FUSEDLM_CAT2(a, b)

const KernelTable& FUSEDLM_CAT(kernel_table_, FUSEDLM_ISA)() {
#define FUSEDLM_KERNEL_ENTRY(name) FUSEDLM_ISA::name,
  static const KernelTable table{FUSEDLM_STR(FUSEDLM_ISA),
                                 FUSEDLM_CPU_KERNELS(FUSEDLM_KERNEL_ENTRY)};
#undef FUSEDLM_KERNEL_ENTRY
  return table;
}

}  // namespace fusedlm::cpu
