// The CUDA kernels' dropout stream materialised as a keep mask, for tests that replay it
// (the kernels themselves never store a mask: they regenerate it from the seed).
#include "common.cuh"
#include "cuda/ops.h"

namespace fusedlm::cuda {
namespace {

// keep[i] = whether element offset + i of the stream is kept; one thread per element.
__global__ void dropout_mask_kernel(Dropout dropout, uint64_t offset, int64_t n,
                                    bool* __restrict__ keep) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  bool kept[1];
  dropout.keep<1>(offset + i, kept);
  keep[i] = kept[0];
}

}  // namespace

at::Tensor dropout_mask(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape, double p,
                        int64_t device_index) {
  TORCH_CHECK_VALUE(offset >= 0, "offset must be >= 0, got ", offset);
  TORCH_CHECK_VALUE(0.0 <= p && p < 1.0, "p must be in [0, 1), got ", p);
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  const c10::cuda::CUDAGuard guard(device);
  auto keep = at::empty(shape, at::TensorOptions().dtype(at::kBool).device(device));
  const int64_t n = keep.numel();
  if (p == 0.0) return keep.fill_(true);
  if (n == 0) return keep;
  const int threads = 256;
  dropout_mask_kernel<<<ceil_div(n, threads), threads, 0, current_stream()>>>(
      dropout_stream(seed, p), static_cast<uint64_t>(offset), n, keep.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep;
}

}  // namespace fusedlm::cuda
