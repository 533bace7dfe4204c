// What the cuda backend's host code shares: the element-type dispatch, alignment checks,
// the switches between kernel paths, the dropout stream, the second stage of the
// parameter-gradient reductions, and the GELU passes that bias_gelu and gelu_ffn share. Their device side is kernels/cuda/common.cuh; the CUDA
// runtime is reached through runtime.h alone.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../common.h"  // csrc/common.h
#include "checks.h"
#include "common.cuh"
#include "cuda/runtime.h"

namespace fusedlm::cuda {

// Runs f(T{}) for the element type T of `dtype`: float, at::Half or at::BFloat16.
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default:
      TORCH_CHECK_TYPE(false, "fusedlm's CUDA kernels take float32, bfloat16 or float16; ",
                       name, " is ", dtype);
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether every pointer is null or 16-byte aligned.
template <typename... P>
bool all_aligned16(const P*... p) {
  return ((p == nullptr || aligned16(p)) && ...);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The switches between kernel paths (set_path and paths, csrc/cuda/paths.cu), read from the
// environment once per process (csrc/cuda/paths.cu); a launch reads the one of its path.
struct KernelPaths {
  std::atomic<bool> attention_resident{true}, attention_wgmma{true}, attention_fused_backward{true},
      ffn_cublas{true}, ffn_wgmma{true};
};
KernelPaths& kernel_paths();

// Whether a kernel's Hopper variant (wgmma.cuh) runs: on an sm_90 device, in a build
// with sm_90a code, when its switch is on (else the mma.sync kernel it replaces).
inline bool hopper_path(const std::atomic<bool>& enabled) {
#if defined(FUSEDLM_SM90A)
  return compute_capability_major() == 9 && enabled;
#else
  (void)enabled;
  return false;
#endif
}

// The dropout stream (seed, p); inactive for p == 0.
inline Dropout dropout_stream(const at::Tensor& seed, double p) {
  Dropout d;
  if (p <= 0.0) return d;
  d.seed = seed_value(seed);
  d.threshold = static_cast<uint32_t>(p * 16777216.0);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  d.active = true;
  return d;
}

// The column sums of partial [blocks, cols] (float32), as a new [cols] tensor of dtype:
// the second stage of a parameter gradient. Zeros when there are no blocks.
template <typename T>
at::Tensor sum_partials(const at::Tensor& partial, at::ScalarType dtype) {
  const int64_t blocks = partial.size(0), cols = partial.size(1);
  auto out = at::empty({cols}, partial.options().dtype(dtype));
  if (cols == 0) return out;
  const int threads = 256;
  launch(sum_partials_kernel<T>, ceil_div(cols, threads), threads, 0, ptr<float>(partial),
         blocks, cols, ptr<T>(out));
  return out;
}

// The elementwise GELU passes (bias_gelu.cu) over 2-D contiguous tensors, bias (over the
// columns) and act optional (undefined): out = dropout(gelu(x + bias)); and
// dx = dropout'(grad) * gelu'(x + bias), with act = dropout(gelu(x + bias)) again when
// defined, returning the bias gradient (the column sums of dx) when want_dbias.
void gelu_forward_pass(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& out,
                       bool tanh, const Dropout& dropout);
at::Tensor gelu_backward_pass(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias,
                              const at::Tensor& dx, const at::Tensor& act, bool tanh,
                              const Dropout& dropout, bool want_dbias);

}  // namespace fusedlm::cuda
