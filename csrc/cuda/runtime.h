// Everything the cuda backend's host code (csrc/cuda/*.cu) needs from the CUDA runtime
// and c10::cuda, and the one place on the host side that knows two builds exist:
//   nvcc (the normal build): c10::cuda's device guard, the device's attributes, and
//     kernel launches on PyTorch's current stream;
//   FUSEDLM_EMULATE (the same sources compiled as C++ against the CPU emulator of CUDA,
//     csrc/emulator): the emulator's launches and attributes, on CPU tensors. A kernel
//     may read or write only the memory of the tensors its op exposed: every pointer a
//     kernel receives comes from ptr(), which exposes the tensor's storage, and the op's
//     DeviceGuard ends those exposures when the op returns.
// Every entry point of the cuda backend (each bound by FUSEDLM_BIND, csrc/bind.h) holds a
// DeviceGuard while it runs.
#pragma once
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#if defined(FUSEDLM_EMULATE)
#include <c10/util/Flags.h>

#include "emulator/runtime.h"

C10_DECLARE_bool(caffe2_cpu_allocator_do_junk_fill);
#else
// c10's CUDA headers, not ATen/cuda/CUDAContext.h: that one needs cuBLAS and cuSPARSE
// headers, which the compile check (CUDA toolkit only, CPU PyTorch) does not have.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <mutex>
#include <set>
#endif

namespace fusedlm::cuda {

// A launch's grid, in blocks along x, y and z, as the host code counts them (int64_t).
// launch() checks it against CUDA's limits before it narrows it to a dim3: a problem too
// large for one launch is an error naming the grid, never a wrapped-around count.
struct Grid {
  Grid(int64_t x_, int64_t y_ = 1, int64_t z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT: implicit
  int64_t x, y, z;

  bool empty() const { return x == 0 || y == 0 || z == 0; }
  dim3 checked() const {
    constexpr int64_t kMaxX = (int64_t(1) << 31) - 1, kMaxYZ = 65535;
    TORCH_CHECK_VALUE(x <= kMaxX && y <= kMaxYZ && z <= kMaxYZ, "fusedlm cuda: the problem needs a grid of (",
                      x, ", ", y, ", ", z, ") blocks, past CUDA's limits of (", kMaxX, ", ", kMaxYZ,
                      ", ", kMaxYZ, ")");
    return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
  }
};

#if defined(FUSEDLM_EMULATE)

// --- the emulation build ------------------------------------------------------------------

inline void check_device_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name,
                    " must be a CPU tensor: this build's cuda backend is emulated on the CPU");
}

// Held by an op for as long as it runs. Meanwhile new CPU tensors are filled with junk
// (c10's allocator's pattern, NaN in floats): like a CUDA allocation they hold no zeros,
// so a kernel that reads memory nothing wrote gives a visibly wrong answer. When it goes,
// so do the op's exposures of memory.
class DeviceGuard {
 public:
  explicit DeviceGuard(const at::Tensor&) : junk_(FLAGS_caffe2_cpu_allocator_do_junk_fill) {
    FLAGS_caffe2_cpu_allocator_do_junk_fill = true;
  }
  DeviceGuard(const at::Tensor& t, const char* name) : DeviceGuard(t) {
    check_device_tensor(t, name);
  }
  explicit DeviceGuard(at::Device) : DeviceGuard(at::Tensor()) {}
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    FLAGS_caffe2_cpu_allocator_do_junk_fill = junk_;
    emu::end_exposure();
  }

 private:
  bool junk_;
};

// The device the kernels run on that PyTorch numbers `index`: the CPU, whatever the index.
inline at::Device kernel_device(int64_t) { return at::Device(at::kCPU); }

inline int multiprocessors() { return emu::multiprocessors(); }
inline size_t max_shared_memory() { return emu::max_shared_memory(); }
inline int compute_capability_major() { return emu::compute_capability_major(); }

// t's data as T*, and t's storage exposed to the op's kernels; nullptr when undefined.
template <typename T>
T* ptr(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  // The pointer first: taking it may give a copy-on-write tensor a storage of its own.
  T* p = static_cast<T*>(t.data_ptr());
  emu::expose(t.storage().data(), t.storage().nbytes());
  return p;
}

// kernel(args...) over grid blocks of block threads, each with dynamic_smem bytes of
// dynamic shared memory, run to completion on the emulator.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Grid grid, dim3 block, size_t dynamic_smem,
            Args&&... args) {
  if (grid.empty()) return;
  emu::launch(kernel, grid.checked(), block, dynamic_smem, std::forward<Args>(args)...);
}

#else

// --- the nvcc build -----------------------------------------------------------------------

inline void check_device_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

// The device of the op's tensors made current for as long as the op runs; given the
// tensor's name, it first checks that the tensor is on a CUDA device.
class DeviceGuard {
 public:
  explicit DeviceGuard(const at::Tensor& t) : guard_(t.device()) {}
  explicit DeviceGuard(at::Device device) : guard_(device) {}
  DeviceGuard(const at::Tensor& t, const char* name)
      : guard_((check_device_tensor(t, name), t.device())) {}

 private:
  c10::cuda::CUDAGuard guard_;
};

// The device the kernels run on that PyTorch numbers `index`: cuda:index.
inline at::Device kernel_device(int64_t index) {
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

// The current device's attributes the launches read, asked of the runtime once per device.
struct DeviceAttributes {
  int multiprocessors = 0;
  size_t max_shared_memory = 0;  // the most one block may ask for
  int compute_capability_major = 0;
};

inline const DeviceAttributes& device_attributes() {
  static DeviceAttributes cached[C10_COMPILE_TIME_MAX_GPUS];
  static std::once_flag asked[C10_COMPILE_TIME_MAX_GPUS];
  const c10::DeviceIndex device = c10::cuda::current_device();
  std::call_once(asked[device], [device] {
    auto attribute = [device](cudaDeviceAttr which) {
      int value = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, which, device));
      return value;
    };
    DeviceAttributes& a = cached[device];
    a.multiprocessors = attribute(cudaDevAttrMultiProcessorCount);
    a.max_shared_memory = static_cast<size_t>(attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
    a.compute_capability_major = attribute(cudaDevAttrComputeCapabilityMajor);
  });
  return cached[device];
}

inline int multiprocessors() { return device_attributes().multiprocessors; }
inline size_t max_shared_memory() { return device_attributes().max_shared_memory; }
inline int compute_capability_major() { return device_attributes().compute_capability_major; }

// Lets `kernel` have as much dynamic shared memory as a block of the current device may,
// once per device and kernel. The allowance is the device's whole, the same for every
// call: a per-call amount could be lowered by another thread's launch between this one's
// setting and launching.
inline void allow_all_shared_memory(const void* kernel) {
  static std::mutex mutex;
  static std::set<std::pair<c10::DeviceIndex, const void*>> allowed;
  const std::pair<c10::DeviceIndex, const void*> key{c10::cuda::current_device(), kernel};
  const std::lock_guard<std::mutex> lock(mutex);
  if (allowed.count(key)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(max_shared_memory())));
  allowed.insert(key);
}

// t's data as T*; nullptr when undefined.
template <typename T>
T* ptr(const at::Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

// kernel<<<grid, block, dynamic_smem>>>(args...) on PyTorch's current stream, checked.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Grid grid, dim3 block, size_t dynamic_smem,
            Args&&... args) {
  if (grid.empty()) return;
  const dim3 blocks = grid.checked();
  // Past 48 KiB a block's dynamic shared memory has to be allowed.
  if (dynamic_smem > 48 * 1024) allow_all_shared_memory(reinterpret_cast<const void*>(kernel));
  kernel<<<blocks, block, dynamic_smem, c10::cuda::getCurrentCUDAStream().stream()>>>(
      std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#endif

}  // namespace fusedlm::cuda
