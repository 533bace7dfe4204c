// Semantics of the tensor-core instructions the CUDA kernels use, as plain functions over
// per-lane arrays: ldmatrix (m8n8 .x4, plain and .trans, 16-bit), mma.sync m16n8k16 (f32
// accumulators, bf16 or fp16 inputs) and wgmma.mma_async m64nNk16 (f32 accumulators, bf16 or
// fp16 inputs, A from shared memory or registers, B from shared memory through a matrix
// descriptor). No runtime here: the caller supplies every lane's operands and a view of
// shared memory, and gets every lane's results.
//
// Everything is written from the PTX ISA (version 9.x), section by section:
//   9.7.14.5.8    Matrix Fragments for mma.m16n8k16 with floating point type
//   9.7.14.5.15   Warp-level matrix load instruction: ldmatrix
//   9.7.15.5.1.1  Register Fragments (wgmma .m64nNk16: matrix A, accumulator D)
//   9.7.15.5.1.2  Shared Memory Matrix Layout (swizzle atoms, Table 38), its
//                 9.7.15.5.1.2.1 Major-ness supported by Strides (leading / stride dimension
//                 byte offsets, canonical layouts) and 9.7.15.5.1.2.2 Matrix Descriptor Format
//   9.7.15.5.2    wgmma.mma_async
// The .cpp names the table each function follows.
//
// Every function checks what the ISA requires of its operands (alignment, addresses inside
// shared memory, valid shapes and descriptor fields) and throws std::invalid_argument with a
// message that says what is wrong.
#pragma once
#include <cstdint>
#include <vector>

namespace fusedlm::emu::isa {

enum class Type { bf16, f16 };

// The value of a 16-bit element: bf16 (the upper half of an IEEE binary32) or f16 (IEEE
// binary16, subnormals, infinities and NaNs included).
float to_float(Type type, uint16_t bits);

// The shared-memory window: the byte at shared address a (as __cvta_generic_to_shared gives
// it) is base[a], for a < size.
struct Window {
  const uint8_t* base;
  uint32_t size;
};

// Bytes [address, address + bytes) of shared memory that an instruction reads.
struct Range {
  uint32_t address, bytes;
};

// --- ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 ------------------------------------

// Lane l supplies address[l], the start of row l % 8 of matrix l / 8 (16 bytes, 16-byte
// aligned). The reads: one 16-byte range per lane, in lane order (not merged).
std::vector<Range> ldmatrix_x4_reads(const uint32_t (&address)[32]);

// out[l][i]: lane l's destination register i (a fragment of matrix i).
void ldmatrix_x4(const Window& w, const uint32_t (&address)[32], bool trans,
                 uint32_t (&out)[32][4]);

// --- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 ----------------------

// D = A B + C with C and D the same registers c: a[l], b[l], c[l] are lane l's fragments.
void mma_m16n8k16(Type type, const uint32_t (&a)[32][4], const uint32_t (&b)[32][2],
                  float (&c)[32][4]);

// --- wgmma matrix descriptors --------------------------------------------------------------

// The fields of a 64-bit matrix descriptor, in bytes. swizzle is the raw mode of bits 62-63:
// 0 no swizzle (interleave), 1 128-byte, 2 64-byte, 3 32-byte.
struct Descriptor {
  uint32_t start, leading_bytes, stride_bytes, base_offset;
  int swizzle;
};
Descriptor decode(uint64_t descriptor);

// The shared address of element (mn, k) of the 16-bit operand that d describes, for one k16
// step: for A, mn is the row m (0..63); for B, mn is the column n (0..N-1); k is 0..15.
// mn_major: the operand is MN-major (imm-trans = 1), else K-major. The swizzle is applied to
// the address as the hardware does (on the absolute shared address). Throws for a layout
// the ISA does not allow (see the .cpp), and for a non-zero matrix base offset, which is not
// implemented.
uint32_t operand_address(const Descriptor& d, bool mn_major, int mn, int k);

// The bytes a k16 step reads of the operand (rows = 64 for A, N for B): sorted, merged.
std::vector<Range> wgmma_reads(uint64_t descriptor, bool mn_major, int rows);

// --- wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16} ----------------------

// n: N, a multiple of 8 in [8, 256]. d[t] points at thread t's (t = 0..127 of the
// warpgroup) N/2 accumulators in the documented order; scale_d == 0: D = A B, else
// D = A B + D. A comes from shared memory, K-major (imm-trans-a = 0), when a_regs is null,
// else from a_regs[t][0..3], thread t's documented register fragment (a_descriptor unused).
// B comes from shared memory, MN-major when b_mn_major (imm-trans-b = 1). imm-scale-a and
// imm-scale-b are 1.
void wgmma(Type type, int n, const uint32_t (*a_regs)[4], uint64_t a_descriptor,
           uint64_t b_descriptor, bool b_mn_major, int scale_d, const Window& w,
           float* const (&d)[128]);

}  // namespace fusedlm::emu::isa
