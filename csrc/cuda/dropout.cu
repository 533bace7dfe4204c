// dropout_mask on CUDA, the host side of kernels/cuda/dropout.cuh.
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "dropout.cuh"
#include "ops.h"

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

}  // namespace fusedlm::cuda
