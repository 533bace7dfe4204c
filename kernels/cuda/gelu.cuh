// GELU and its derivative in float32, erf (approximate = "none") or tanh form, for the
// bias_gelu kernels (bias_gelu.cuh) and the FFN's matrix-product epilogues (gelu_ffn.cuh).
#pragma once
#include "common.cuh"

namespace fusedlm::cuda {

__device__ __forceinline__ float tanh_stable(float u) {
  // From exp(-2|u|) <= 1, which cannot overflow; tanhf is an approximation under
  // --use_fast_math, this stays within a few ulp.
  const float e = __expf(-2.0f * fabsf(u));
  return copysignf((1.0f - e) / (1.0f + e), u);
}

template <bool kTanh>
__device__ __forceinline__ float gelu(float z) {
  if constexpr (kTanh) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    return 0.5f * z * (1.0f + tanh_stable(u));
  } else {
    return 0.5f * z * (1.0f + erff(z * 0.7071067811865476f));
  }
}

// d gelu(z) / dz.
template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float z) {
  if constexpr (kTanh) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    const float t = tanh_stable(u);
    const float du = 0.7978845608028654f * (1.0f + 0.134145f * z * z);
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * du;
  } else {
    const float cdf = 0.5f * (1.0f + erff(z * 0.7071067811865476f));
    return cdf + z * 0.3989422804014327f * __expf(-0.5f * z * z);
  }
}

}  // namespace fusedlm::cuda
