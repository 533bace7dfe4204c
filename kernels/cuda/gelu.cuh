// GELU and its derivative in float32, erf (approximate = "none") or tanh form, for the
// bias_gelu kernels (bias_gelu.cu) and the FFN's matrix-product epilogues (gelu_ffn.cu).
#pragma once
#include "common.cuh"

namespace fusedlm::cuda {

// Both forms are written so that nothing cancels for negative z, where GELU's value is
// a small fraction of z: the tanh form's 0.5 * (1 + tanh(u)) as sigmoid(2u), the erf
// form's 0.5 * (1 + erf(z / sqrt(2))) as 0.5 * erfc(-z / sqrt(2)).
__device__ __forceinline__ float normal_cdf(float z) { return 0.5f * erfcf(-z * 0.7071067811865476f); }

template <bool kTanh>
__device__ __forceinline__ float gelu(float z) {
  if constexpr (kTanh) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    return z / (1.0f + __expf(-2.0f * u));
  } else {
    return z * normal_cdf(z);
  }
}

// d gelu(z) / dz.
template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float z) {
  if constexpr (kTanh) {
    // s = sigmoid(2u), e = exp(-2u): s + z * 2 s (1 - s) du, with s (1 - s) = (e s) s. u is
    // clamped where s has saturated, so that e stays finite (inf * 0 would be NaN).
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    const float e = __expf(-2.0f * fminf(fmaxf(u, -40.0f), 40.0f));
    const float s = 1.0f / (1.0f + e);
    const float du = 0.7978845608028654f * (1.0f + 0.134145f * z * z);
    return s + 2.0f * z * du * ((e * s) * s);
  } else {
    return normal_cdf(z) + z * 0.3989422804014327f * __expf(-0.5f * z * z);
  }
}

}  // namespace fusedlm::cuda
