// Fills this instruction set's KernelTable (see kernels.h).
#include "math.h"

namespace fusedlm::cpu {
namespace FUSEDLM_ISA {
void dropout_mask(uint64_t, uint64_t, int64_t, double, uint8_t*);
void bias_gelu_forward(DType, const void*, const void*, void*, int64_t, int64_t, Gelu,
                       const uint8_t*, double);
void bias_gelu_backward(DType, const void*, const void*, const void*, void*, void*, int64_t,
                        int64_t, Gelu, const uint8_t*, double);
void add_layer_norm_forward(DType, const void*, const void*, const void*, const void*, void*,
                            void*, void*, void*, int64_t, int64_t, double, const uint8_t*,
                            double);
void add_layer_norm_backward(DType, const void*, const void*, const void*, const void*,
                             const void*, const void*, void*, void*, void*, void*, int64_t,
                             int64_t, const uint8_t*, double);
}  // namespace FUSEDLM_ISA

#define FUSEDLM_STR2(x) #x
#define FUSEDLM_STR(x) FUSEDLM_STR2(x)
#define FUSEDLM_CAT2(a, b) a##b
#define FUSEDLM_CAT(a, b) FUSEDLM_CAT2(a, b)

const KernelTable& FUSEDLM_CAT(kernel_table_, FUSEDLM_ISA)() {
  namespace k = FUSEDLM_ISA;
  static const KernelTable table{
      FUSEDLM_STR(FUSEDLM_ISA),
      k::dropout_mask,
      k::bias_gelu_forward,
      k::bias_gelu_backward,
      k::add_layer_norm_forward,
      k::add_layer_norm_backward,
  };
  return table;
}

}  // namespace fusedlm::cpu
