// Tensor-core instruction semantics (isa.h), each function following the PTX ISA section
// named in its comment. Indices used throughout, as the ISA names them:
//   lane       %laneid, 0..31 (thread t of a warpgroup: warp t / 32, lane t % 32)
//   groupID            = lane >> 2
//   threadID_in_group  = lane % 4
// A 32-bit register holding two 16-bit elements keeps the lower-numbered element (a0 of
// a0, a1) in its low half, as .f16x2 / .bf16x2 registers do (ISA 5.2.4.1, Packed floating
// point data types), and memory is little-endian: the element at the lower address of a
// 4-byte word lands in the low half.
#include "emulator/isa.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fusedlm::emu::isa {
namespace {

[[noreturn]] void fail(const char* instruction, const std::string& what) {
  throw std::invalid_argument(std::string(instruction) + ": " + what);
}

std::string hex(uint64_t value) {
  char text[32];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

std::string str(int64_t value) { return std::to_string(value); }

uint16_t load16(const Window& w, uint64_t address, const char* instruction) {
  if (address % 2 != 0)
    fail(instruction, "element address " + hex(address) + " is not 2-byte aligned");
  if (address + 2 > w.size) {
    fail(instruction, "reads bytes [" + hex(address) + ", " + hex(address + 2) +
                          ") outside shared memory (" + str(w.size) + " bytes)");
  }
  const uint8_t* p = w.base + address;
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

uint16_t lo(uint32_t r) { return static_cast<uint16_t>(r & 0xFFFFu); }
uint16_t hi(uint32_t r) { return static_cast<uint16_t>(r >> 16); }
uint32_t pack(uint16_t low, uint16_t high) { return uint32_t(low) | uint32_t(high) << 16; }

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void check_type(Type type, const char* instruction) {
  if (type != Type::bf16 && type != Type::f16) {
    fail(instruction, "unknown element type " + str(static_cast<int>(type)));
  }
}

}  // namespace

// bf16: the upper 16 bits of an IEEE binary32 (its value is that float's). f16: IEEE 754
// binary16, 1 sign bit, 5 exponent bits (bias 15), 10 fraction bits: exponent 0 holds zero
// and the subnormals fraction * 2^-24, exponent 31 the infinities (fraction 0) and NaNs.
float to_float(Type type, uint16_t bits) {
  check_type(type, "to_float");
  if (type == Type::bf16) return bits_to_float(uint32_t(bits) << 16);
  const uint32_t sign = uint32_t(bits >> 15) << 31;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t fraction = bits & 0x3FFu;
  if (exponent == 0) {
    // A subnormal (or zero) is exactly fraction * 2^-24; the product is exact in float.
    const float magnitude = static_cast<float>(fraction) * bits_to_float(0x33800000u);  // 2^-24
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) {
    // Infinity, or a NaN keeping its payload in the top fraction bits (and quiet).
    return bits_to_float(sign | 0x7F800000u | (fraction << 13) | (fraction ? 0x00400000u : 0u));
  }
  return bits_to_float(sign | (exponent - 15 + 127) << 23 | fraction << 13);
}

// --- ldmatrix ----------------------------------------------------------------------------
//
// ISA 9.7.14.5.15 (ldmatrix): with .num = .x4, threads 0-7 give addr0-addr7 (the rows of the
// first matrix), threads 8-15 those of the second, 16-23 the third, 24-31 the fourth. Each
// address is the start of a row of eight 16-bit elements (16 bytes), "naturally aligned". The
// destination register i holds a fragment of matrix i. Figure 104 (ldmatrix fragment layout
// for one 8x8 matrix with 16-bit elements): thread 0 receives the first fragment and so on,
// a group of four consecutive threads loads an entire row, so lane l receives row l / 4,
// elements 2 (l % 4) and 2 (l % 4) + 1. With .trans the matrix is loaded in column-major
// format: lane l receives the same position of the transposed matrix, i.e. elements
// (row 2 (l % 4), column l / 4) and (row 2 (l % 4) + 1, column l / 4) of the stored matrix.

namespace {

void check_ldmatrix_alignment(const uint32_t (&address)[32]) {
  for (int lane = 0; lane < 32; ++lane) {
    if (address[lane] % 16 != 0) {
      fail("ldmatrix.x4", "lane " + str(lane) + " gives row address " + hex(address[lane]) +
                              " (row " + str(lane % 8) + " of matrix " + str(lane / 8) +
                              "), which is not 16-byte aligned");
    }
  }
}

}  // namespace

std::vector<Range> ldmatrix_x4_reads(const uint32_t (&address)[32]) {
  check_ldmatrix_alignment(address);
  std::vector<Range> reads;
  reads.reserve(32);
  for (int lane = 0; lane < 32; ++lane) reads.push_back({address[lane], 16});
  return reads;
}

void ldmatrix_x4(const Window& w, const uint32_t (&address)[32], bool trans,
                 uint32_t (&out)[32][4]) {
  check_ldmatrix_alignment(address);
  for (int lane = 0; lane < 32; ++lane) {
    if (uint64_t(address[lane]) + 16 > w.size) {
      fail("ldmatrix.x4", "lane " + str(lane) + " gives row address " + hex(address[lane]) +
                              ": bytes [" + hex(address[lane]) + ", " +
                              hex(uint64_t(address[lane]) + 16) + ") are outside shared memory (" +
                              str(w.size) + " bytes)");
    }
  }
  // element(m, r, c): matrix m, row r, column c as stored.
  auto element = [&](int m, int r, int c) {
    return load16(w, uint64_t(address[8 * m + r]) + 2 * c, "ldmatrix.x4");
  };
  uint32_t result[32][4];
  for (int lane = 0; lane < 32; ++lane) {
    for (int m = 0; m < 4; ++m) {
      if (!trans) {
        result[lane][m] =
            pack(element(m, lane / 4, 2 * (lane % 4)), element(m, lane / 4, 2 * (lane % 4) + 1));
      } else {
        result[lane][m] =
            pack(element(m, 2 * (lane % 4), lane / 4), element(m, 2 * (lane % 4) + 1, lane / 4));
      }
    }
  }
  std::memcpy(out, result, sizeof(result));
}

// --- mma.sync m16n8k16 -----------------------------------------------------------------------
//
// ISA 9.7.14.5.8 (Matrix Fragments for mma.m16n8k16 with floating point type), .f16/.bf16:
//   A (16 x 16): four .f16x2 registers holding a0..a7 (a0, a1 in register 0, ...):
//     row = groupID        for ai with 0 <= i < 2 or 4 <= i < 6, groupID + 8 otherwise
//     col = threadID_in_group * 2 + (i & 1)  for i < 4,  the same + 8 for i >= 4
//   B (16 x 8): two .f16x2 registers holding b0..b3:
//     row = threadID_in_group * 2 + (i & 1)  for i < 2,  the same + 8 for i >= 2
//     col = groupID
//   C, D (16 x 8), .f32: four registers c0..c3:
//     row = groupID for i < 2, groupID + 8 for i >= 2;  col = threadID_in_group * 2 + (i & 1)
// .row.col: A is row-major and B column-major in the fragments above (the only layout of
// this shape). 9.7.14.5.14 (mma): D = A * B + C; the products and the f32 accumulation are
// at least single precision. Here each product of two 16-bit values is exact in float and
// the sum is accumulated in float, starting from C, in k order 0..15.

namespace {

int mma_a_row(int lane, int i) { return lane / 4 + ((i / 2) % 2) * 8; }
int mma_a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
int mma_b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
int mma_b_col(int lane, int /*i*/) { return lane / 4; }
int mma_c_row(int lane, int i) { return lane / 4 + (i >= 2 ? 8 : 0); }
int mma_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

// Element i of a fragment of 16-bit pairs: register i / 2, low half for even i.
uint16_t half_of(const uint32_t* regs, int i) {
  return i % 2 == 0 ? lo(regs[i / 2]) : hi(regs[i / 2]);
}

}  // namespace

void mma_m16n8k16(Type type, const uint32_t (&a)[32][4], const uint32_t (&b)[32][2],
                  float (&c)[32][4]) {
  check_type(type, "mma.m16n8k16");
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i)
      A[mma_a_row(lane, i)][mma_a_col(lane, i)] = to_float(type, half_of(a[lane], i));
    for (int i = 0; i < 4; ++i)
      B[mma_b_row(lane, i)][mma_b_col(lane, i)] = to_float(type, half_of(b[lane], i));
  }
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const int row = mma_c_row(lane, i), col = mma_c_col(lane, i);
      float acc = c[lane][i];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      c[lane][i] = acc;
    }
  }
}

// --- wgmma matrix descriptors ------------------------------------------------------------------
//
// ISA 9.7.15.5.1.2.2 (Matrix Descriptor Format), a 64-bit value:
//   bits 13-0   matrix-descriptor-encode(matrix start address)
//   bits 29-16  matrix-descriptor-encode(leading dimension byte offset)
//   bits 45-32  matrix-descriptor-encode(stride dimension byte offset)
//   bits 51-49  matrix base offset (all swizzling modes but no-swizzle)
//   bits 63-62  swizzling mode: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
// with matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4: addresses and offsets are in
// 16-byte units. The other bits are not fields and are ignored.

Descriptor decode(uint64_t descriptor) {
  Descriptor d;
  d.start = static_cast<uint32_t>(descriptor & 0x3FFFu) << 4;
  d.leading_bytes = static_cast<uint32_t>((descriptor >> 16) & 0x3FFFu) << 4;
  d.stride_bytes = static_cast<uint32_t>((descriptor >> 32) & 0x3FFFu) << 4;
  d.base_offset = static_cast<uint32_t>((descriptor >> 49) & 0x7u);
  d.swizzle = static_cast<int>((descriptor >> 62) & 0x3u);
  return d;
}

// ISA 9.7.15.5.1.2 (Shared Memory Matrix Layout). An operand is made of swizzle atoms; Table
// 38 gives their shapes in 128-bit (16-byte) elements: with the 128-byte swizzle 8 x 8 for
// both K-major and MN-major, 64-byte: 8 x 4 (K) / 4 x 8 (MN), 32-byte: 8 x 2 / 2 x 8, none:
// 8 x 1 / 1 x 8. So a swizzled atom is 8 "rows" of S bytes (S = 128, 64, 32, the swizzle
// width): for K-major a row is one m (or n) and holds S / 2 consecutive k; for MN-major a
// row is one k and holds S / 2 consecutive m (or n). The canonical layouts (9.7.15.5.1.2.1.3,
// CuTe notation, in elements, T = 8 elements of 16 bits per 16 bytes; for B read n for m):
//   K-major,  128B:  Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T))
//             64B:   Swizzle<2,4,3> o ((8,m),(T,2k)):((4T,SBO),(1,T))
//             32B:   Swizzle<1,4,3> o ((8,m),(T,2k)):((2T,SBO),(1,T))
//             none:  Swizzle<0,4,3> o ((8,m),(T,2k)):((1T,SBO),(1,LBO))
//   MN-major, 128B:  Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
//             64B:   Swizzle<2,4,3> o ((T,4,m),(8,k)):((1,T,LBO),(4T,SBO))
//             32B:   Swizzle<1,4,3> o ((T,2,m),(8,k)):((1,T,LBO),(2T,SBO))
//             none:  Swizzle<0,4,3> o ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))
// which, for a k16 step (k = 0..15) of a 16-bit operand, gives the byte offsets from the
// start address (S = 16 W, W = 8, 4, 2 chunks of 16 bytes per atom row):
//   K-major swizzled:   (mn / 8) SBO + (mn % 8) S  + (k / 8) 16  + (k % 8) 2
//     rows of an atom S bytes apart, 8-row groups SBO apart ("the offset from the first 8
//     rows to the next 8 rows", 9.7.15.5.1.2.1.2); the two 16-byte chunks of k (0-7, 8-15)
//     side by side in the row; LBO "not used, assumed to be 1" (9.7.15.5.1.2.1.1).
//   MN-major swizzled:  (mn / (S/2)) LBO + (mn % (S/2)) 2 + (k / 8) SBO + (k % 8) S
//     S / 2 consecutive mn in a row, one row per k; atoms along MN LBO apart ("offset from
//     the first (swizzle-byte-size/16) rows to the next", in 128-bit rows along MN), groups
//     of 8 k SBO apart ("offset from the first 8 columns to the next 8 columns").
//   K-major none:       (mn / 8) SBO + (mn % 8) 16 + (k / 8) LBO + (k % 8) 2
//   MN-major none:      (mn / 8) SBO + (mn % 8) 2  + (k / 8) LBO + (k % 8) 16
// The swizzle Swizzle<B,4,3> (B = 3, 2, 1 for 128, 64, 32 bytes) is CuTe's functor
// x ^ ((x >> 3) & (((1 << B) - 1) << 4)): bits [4, 4 + B) of the byte address, the 16-byte
// chunk within a row, are XORed with bits [7, 7 + B). The hardware applies it to the shared
// address it forms, start + offset, so the pattern is tied to absolute addresses: it repeats
// every 8 S bytes (1024, 512, 256), and "the base offset is 0 when the repeating pattern
// starts" on such a boundary (9.7.15.5.1.2.2); otherwise the base offset field must say where
// it starts. Only a base offset of 0 is implemented here.
//
// What this accepts of a swizzled operand (beyond the ISA's 16-byte alignment of the start,
// which the encoding already guarantees), and why:
//   * base offset 0 (others are rejected as not implemented), and then the start address in
//     the first S-byte row of an 8 S-byte pattern: a start further into the pattern would
//     need a non-zero base offset (the ISA's formula gives (start >> 7) & 7 for 128 bytes).
//   * K-major: the 32 bytes of a k16 step inside one S-byte row of the atom (start % S <= S -
//     32); the layout has no stride that leaves the row. MN-major: the mn read inside the row
//     (start % S + 2 (mn % (S/2)) < S).
//   * the strides that are used (SBO for mn >= 8 in K-major; LBO for mn >= S/2 and SBO for
//     k >= 8 in MN-major) multiples of the 8 S-byte pattern, so every atom starts on a
//     pattern boundary as the base offset 0 says.
//   * K-major: the leading byte offset, which the hardware ignores, 0 or 16 (encoded 0 or
//     the ISA's "assumed 1"): any other value means the layout was described wrongly (it is
//     where an MN-major LBO or a K-major no-swizzle LBO would go), so it is reported rather
//     than silently tolerated. This is stricter than the hardware.

namespace {

constexpr const char* kWgmma = "wgmma";

// Width in bytes of a row of the swizzle atom (the swizzle width), 0 for none.
uint32_t swizzle_bytes(int mode) {
  switch (mode) {
    case 1: return 128;
    case 2: return 64;
    case 3: return 32;
    default: return 0;
  }
}

std::string mode_name(int mode) {
  switch (mode) {
    case 0: return "no-swizzle";
    case 1: return "128-byte swizzle";
    case 2: return "64-byte swizzle";
    case 3: return "32-byte swizzle";
    default: return "swizzle mode " + str(mode);
  }
}

}  // namespace

uint32_t operand_address(const Descriptor& d, bool mn_major, int mn, int k) {
  if (mn < 0 || mn >= 256) fail(kWgmma, "operand index mn = " + str(mn) + " is outside 0..255");
  if (k < 0 || k >= 16)
    fail(kWgmma, "operand index k = " + str(k) + " is outside 0..15 (one k16 step)");
  if (d.swizzle < 0 || d.swizzle > 3)
    fail(kWgmma, "swizzle mode " + str(d.swizzle) + " does not exist (0..3)");
  if (d.start % 16 || d.leading_bytes % 16 || d.stride_bytes % 16) {
    fail(kWgmma, "descriptor start " + hex(d.start) + ", leading byte offset " +
                     str(d.leading_bytes) + " and stride byte offset " + str(d.stride_bytes) +
                     " must be 16-byte aligned");
  }
  const char* major = mn_major ? "MN-major" : "K-major";
  const uint64_t S = swizzle_bytes(d.swizzle);
  uint64_t offset;
  if (S == 0) {
    // No swizzle (interleave); the base offset field does not apply.
    if (!mn_major) {
      offset = uint64_t(mn / 8) * d.stride_bytes + (mn % 8) * 16 +
               uint64_t(k / 8) * d.leading_bytes + (k % 8) * 2;
    } else {
      offset = uint64_t(mn / 8) * d.stride_bytes + (mn % 8) * 2 +
               uint64_t(k / 8) * d.leading_bytes + (k % 8) * 16;
    }
    return static_cast<uint32_t>(d.start + offset);
  }
  const std::string what = std::string(major) + " " + mode_name(d.swizzle) + " operand: ";
  if (d.base_offset != 0) {
    fail(kWgmma, what + "matrix base offset " + str(d.base_offset) +
                     " is not implemented (only patterns starting on a " + str(8 * S) +
                     "-byte boundary, base offset 0)");
  }
  const uint64_t pattern = 8 * S, in_row = d.start % S;
  if ((d.start / S) % 8 != 0) {
    const std::string boundary = str(pattern) + "-byte";
    fail(kWgmma, what + "start address " + hex(d.start) + " lies in row " +
                     str((d.start / S) % 8) + " of its " + boundary +
                     " swizzle pattern; with base offset 0 the pattern must start at a " +
                     boundary + " boundary (is the tile " + boundary + " aligned?)");
  }
  if (!mn_major) {
    if (d.leading_bytes != 0 && d.leading_bytes != 16) {
      fail(kWgmma, what + "leading byte offset " + str(d.leading_bytes) +
                       " given, but it is unused for swizzled K-major layouts (the ISA: "
                       "assumed 1, i.e. 16 bytes); is the operand MN-major, or the offsets "
                       "swapped?");
    }
    if (in_row + 32 > S) {
      fail(kWgmma, what + "start address " + hex(d.start) + " is " + str(in_row) +
                       " bytes into a " + str(S) +
                       "-byte atom row, so the k16 step's 32 bytes would leave the row");
    }
    if (mn >= 8 && d.stride_bytes % pattern != 0) {
      fail(kWgmma, what + "stride byte offset " + str(d.stride_bytes) +
                       " (between 8-row groups) is not a multiple of the " + str(pattern) +
                       "-byte swizzle pattern");
    }
    offset = uint64_t(mn / 8) * d.stride_bytes + (mn % 8) * S + (k / 8) * 16 + (k % 8) * 2;
  } else {
    const int per_row = static_cast<int>(S / 2);  // elements along MN in one atom row
    if (in_row + 2 * (mn % per_row) >= S) {
      fail(kWgmma, what + "start address " + hex(d.start) + " is " + str(in_row) +
                       " bytes into a " + str(S) + "-byte atom row, so element mn = " + str(mn) +
                       " would leave the row");
    }
    if (mn >= per_row && d.leading_bytes % pattern != 0) {
      fail(kWgmma, what + "leading byte offset " + str(d.leading_bytes) + " (between atoms of " +
                       str(per_row) + " along MN) is not a multiple of the " + str(pattern) +
                       "-byte swizzle pattern");
    }
    if (k >= 8 && d.stride_bytes % pattern != 0) {
      fail(kWgmma, what + "stride byte offset " + str(d.stride_bytes) +
                       " (between groups of 8 k) is not a multiple of the " + str(pattern) +
                       "-byte swizzle pattern");
    }
    offset = uint64_t(mn / per_row) * d.leading_bytes + (mn % per_row) * 2 +
             uint64_t(k / 8) * d.stride_bytes + (k % 8) * S;
  }
  uint64_t address = d.start + offset;
  const uint64_t mask = S / 16 - 1;  // 7, 3, 1: the B low bits of the row index
  address ^= ((address >> 7) & mask) << 4;
  if (address > 0xFFFFFFFFull) fail(kWgmma, what + "address " + hex(address) + " overflows");
  return static_cast<uint32_t>(address);
}

std::vector<Range> wgmma_reads(uint64_t descriptor, bool mn_major, int rows) {
  if (rows < 8 || rows > 256 || rows % 8 != 0) {
    fail(kWgmma, "operand rows = " + str(rows) + " is not a multiple of 8 in 8..256");
  }
  const Descriptor d = decode(descriptor);
  std::vector<Range> chunks;
  // Every 16-byte chunk holds 8 elements that stay together (the swizzle moves whole chunks):
  // along k for K-major, along mn for MN-major.
  if (!mn_major) {
    for (int mn = 0; mn < rows; ++mn)
      for (int k = 0; k < 16; k += 8) chunks.push_back({operand_address(d, false, mn, k), 16});
  } else {
    for (int mn = 0; mn < rows; mn += 8)
      for (int k = 0; k < 16; ++k) chunks.push_back({operand_address(d, true, mn, k), 16});
  }
  std::sort(chunks.begin(), chunks.end(),
            [](const Range& x, const Range& y) { return x.address < y.address; });
  std::vector<Range> merged;
  for (const Range& r : chunks) {
    if (!merged.empty() && uint64_t(merged.back().address) + merged.back().bytes >= r.address) {
      const uint64_t end = std::max<uint64_t>(uint64_t(merged.back().address) + merged.back().bytes,
                                              uint64_t(r.address) + r.bytes);
      merged.back().bytes = static_cast<uint32_t>(end - merged.back().address);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

// --- wgmma.mma_async m64nNk16 ------------------------------------------------------------------
//
// ISA 9.7.15.5.2 (wgmma.mma_async): D = A * B + D, or D = A * B when scale-d is false; A is
// M x K (64 x 16), B is K x N, D is M x N; N a multiple of 8 from 8 to 256 for .f16/.bf16.
// "Matrices A and B are stored in row-major and column-major format respectively" (K-major),
// imm-trans-a / imm-trans-b = 1 transposes them (MN-major), only from shared memory.
// The element-wise products are at least single precision, the f32 accumulation at least
// single precision, its order unspecified; here: exact products, float sums in k order.
//
// ISA 9.7.15.5.1.1.1 (Matrix Fragments for wgmma.mma_async.m64nNk16), Figures 148 and 149
// (cross-checked with CUTLASS's ALayout_64x16 and CLayout_64xN): warp w = t / 32 of the
// warpgroup owns rows 16 w .. 16 w + 15, and within them
//   A (registers a0..a7 in four .f16x2 registers) is laid out as mma.m16n8k16's A:
//     row = 16 w + groupID + 8 ((i / 2) % 2),  col = 2 threadID_in_group + (i % 2) + 8 (i / 4)
//   D (N/2 f32 registers d0..d(N/2 - 1)), each group of four d(4j)..d(4j+3) as
//     mma.m16n8k16's C for columns 8 j .. 8 j + 7:
//     row = 16 w + groupID + 8 ((i / 2) % 2),  col = 8 (i / 4) + 2 threadID_in_group + (i % 2)

namespace {

int wg_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2); }
int wg_a_col(int t, int i) { return 2 * (t % 4) + (i % 2) + 8 * (i / 4); }
int wg_d_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + (i % 2); }

}  // namespace

void wgmma(Type type, int n, const uint32_t (*a_regs)[4], uint64_t a_descriptor,
           uint64_t b_descriptor, bool b_mn_major, int scale_d, const Window& w,
           float* const (&d)[128]) {
  check_type(type, kWgmma);
  if (n < 8 || n > 256 || n % 8 != 0)
    fail(kWgmma, "N = " + str(n) + " is not a multiple of 8 in 8..256 (m64nNk16)");
  for (int t = 0; t < 128; ++t) {
    if (d[t] == nullptr) fail(kWgmma, "thread " + str(t) + " has no accumulator registers");
  }
  // Gather A (64 x 16) and B (16 x N) first, so that a bad operand throws before any
  // accumulator is written.
  std::vector<float> A(64 * 16), B(16 * size_t(n));
  if (a_regs != nullptr) {
    for (int t = 0; t < 128; ++t)
      for (int i = 0; i < 8; ++i)
        A[wg_row(t, i) * 16 + wg_a_col(t, i)] = to_float(type, half_of(a_regs[t], i));
  } else {
    const Descriptor da = decode(a_descriptor);
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k)
        A[m * 16 + k] = to_float(type, load16(w, operand_address(da, false, m, k), "wgmma (A)"));
  }
  const Descriptor db = decode(b_descriptor);
  for (int k = 0; k < 16; ++k)
    for (int col = 0; col < n; ++col)
      B[k * n + col] =
          to_float(type, load16(w, operand_address(db, b_mn_major, col, k), "wgmma (B)"));
  for (int t = 0; t < 128; ++t) {
    for (int i = 0; i < n / 2; ++i) {
      const int row = wg_row(t, i), col = wg_d_col(t, i);
      float acc = scale_d != 0 ? d[t][i] : 0.0f;
      for (int k = 0; k < 16; ++k) acc += A[row * 16 + k] * B[k * n + col];
      d[t][i] = acc;
    }
  }
}

}  // namespace fusedlm::emu::isa
