// The CUDA kernels' dropout stream materialised as a keep mask, for tests that replay it
// (the kernels themselves never store a mask: they regenerate it from the seed).
#include <cstdint>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "bind.h"

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

// --- host side: checks, launch shapes and launches ------------------------------------

namespace fusedlm::cuda {

at::Tensor dropout_mask(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape, double p,
                        int64_t device_index) {
  const at::Device device = kernel_device(device_index);
  const DeviceGuard guard(device);
  auto keep = at::empty(shape, at::TensorOptions().dtype(at::kBool).device(device));
  const int64_t n = keep.numel();
  if (p <= 0.0) return keep.fill_(true);
  if (n == 0) return keep;
  const int threads = 256;
  launch(kernels::dropout::dropout_mask_kernel, ceil_div(n, threads), threads, 0,
         dropout_stream(seed, p), static_cast<uint64_t>(offset), n, ptr<bool>(keep));
  return keep;
}
FUSEDLM_BIND(dropout_mask, pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("shape"),
             pybind11::arg("p"), pybind11::arg("device_index"));

}  // namespace fusedlm::cuda
