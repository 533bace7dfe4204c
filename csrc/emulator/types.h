// The CUDA vector types the kernels and their host code use (dim3, uint4), for the
// emulation build, where no CUDA header is included.
#pragma once
#include <cstdint>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct uint4 {
  uint32_t x, y, z, w;
};

inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
