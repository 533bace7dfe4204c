// Fills this instruction set's KernelTable (see kernels.h).
#include "math.h"

namespace fusedlm::cpu {
namespace FUSEDLM_ISA {
void dropout_mask(uint64_t, uint64_t, int64_t, double, uint8_t*);
void bias_gelu_forward(DType, const void*, const void*, void*, int64_t, int64_t, Gelu,
                       const uint8_t*, double);
void bias_gelu_backward(DType, const void*, const void*, const void*, void*, void*, int64_t,
                        int64_t, Gelu, const uint8_t*, double);
void cross_entropy_forward(DType, const void*, const int64_t*, void*, void*, void*, int64_t,
                           int64_t, int64_t, double, double, const void*);
void cross_entropy_scale_grad(DType, const void*, void*, int64_t, int64_t, const void*, int64_t);
void attn_pack(DType, const void*, int64_t, int64_t, const int32_t*, int64_t, int64_t, void*);
void attn_unpack(DType, const void*, const int32_t*, int64_t, int64_t, double, void*, int64_t,
                 int64_t, int64_t, int64_t, int64_t);
void attn_dropout_keep(uint64_t, double, uint64_t, int64_t, int64_t, const int32_t*, int64_t,
                       uint8_t*, uint8_t*);
void attn_forward_block(const AttnTile*, bool, void*, void*, void*, void*, int64_t);
void attn_forward_finish(DType, int64_t, int64_t, const void*, const void*, const void*, void*,
                         void*, int64_t, int64_t);
void attn_delta(DType, const void*, int64_t, int64_t, const void*, int64_t, int64_t, int64_t,
                void*);
void attn_backward_block(const AttnTile*, void*, void*, const void*, void*, bool);
void attn_bias_grad(const AttnTile*, const void*, void*, int64_t, int64_t);
void add_layer_norm_forward(DType, const void*, const void*, const void*, const void*, void*,
                            void*, void*, void*, int64_t, int64_t, double, const uint8_t*,
                            double);
void add_layer_norm_backward(DType, const void*, const void*, const void*, const void*,
                             const void*, const void*, void*, void*, void*, void*, int64_t,
                             int64_t, const uint8_t*, double);
void lstm_cell_forward(DType, const void*, const void*, void*, void*, int64_t, int64_t, double);
void lstm_cell_backward(DType, const void*, const void*, const void*, const void*, void*, void*,
                        int64_t, int64_t, double);
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
      k::cross_entropy_forward,
      k::cross_entropy_scale_grad,
      k::attn_pack,
      k::attn_unpack,
      k::attn_dropout_keep,
      k::attn_forward_block,
      k::attn_forward_finish,
      k::attn_delta,
      k::attn_backward_block,
      k::attn_bias_grad,
      k::add_layer_norm_forward,
      k::add_layer_norm_backward,
      k::lstm_cell_forward,
      k::lstm_cell_backward,
  };
  return table;
}

}  // namespace fusedlm::cpu
