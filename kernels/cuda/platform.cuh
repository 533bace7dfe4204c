// What the kernels compile against, and the one place on the device side that knows two
// builds exist. nvcc (the normal build): CUDA's headers and the inline PTX of ptx.cuh.
// FUSEDLM_EMULATE (the kernels compiled as plain C++ for the CPU emulator of CUDA,
// csrc/emulator): the emulator's stand-ins for the same names, the built-in variables and
// intrinsics, the __global__/__device__ qualifiers, the bf16/fp16 pair types, and
// fusedlm::cuda::ptx emulated. The kernels themselves are the same source either way.
#pragma once
#if defined(FUSEDLM_EMULATE)
#include "emulator/device.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ptx.cuh"
#endif
