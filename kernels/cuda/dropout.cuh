// The CUDA kernels' dropout stream materialised as a keep mask, for tests that replay it
// (the kernels themselves never store a mask: they regenerate it from the seed).
#pragma once
#include <cstdint>

#include "common.cuh"

namespace fusedlm::cuda::kernels::dropout {

// keep[i] = whether element offset + i of the stream is kept; one thread per element.
__global__ void dropout_mask_kernel(Dropout dropout, uint64_t offset, int64_t n,
                                    bool* __restrict__ keep) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  bool kept[1];
  dropout.keep<1>(offset + i, kept);
  keep[i] = kept[0];
}

}  // namespace fusedlm::cuda::kernels::dropout
