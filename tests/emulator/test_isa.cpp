// Tests of the tensor-core instruction semantics (csrc/emulator/isa.h) against the PTX ISA's
// own tables, on hand-made inputs. The expected values here are built from the ISA text
// independently of isa.cpp's formulas where the ISA offers a second description: Table 38's
// swizzle atoms (an 8-row atom whose 16-byte chunk c of row r sits at chunk c ^ r) against
// isa.cpp's byte-offset formulas, and the canonical CuTe layouts and worked examples of
// 9.7.15.5.1.2.1.3, evaluated literally, against both.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "emulator/isa.h"
#include "harness.h"

namespace isa = fusedlm::emu::isa;
using isa::Type;

namespace {

// --- values ------------------------------------------------------------------------------

// The value of a 16-bit pattern, computed with ldexp from the format's definition (a second
// decoder, to check isa::to_float against).
double reference_value(Type type, uint16_t bits) {
  const int sign = bits >> 15;
  const int exponent_bits = type == Type::f16 ? 5 : 8;
  const int fraction_bits = type == Type::f16 ? 10 : 7;
  const int bias = type == Type::f16 ? 15 : 127;
  const int exponent = (bits >> fraction_bits) & ((1 << exponent_bits) - 1);
  const int fraction = bits & ((1 << fraction_bits) - 1);
  double magnitude;
  if (exponent == (1 << exponent_bits) - 1) {
    magnitude = fraction ? std::numeric_limits<double>::quiet_NaN()
                         : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(double(fraction), 1 - bias - fraction_bits);
  } else {
    magnitude =
        std::ldexp(double(fraction + (1 << fraction_bits)), exponent - bias - fraction_bits);
  }
  return sign ? -magnitude : magnitude;
}

// The pattern of v, which must be exactly representable (a normal number or zero).
uint16_t encode(Type type, double v) {
  if (v == 0) return 0;
  const int fraction_bits = type == Type::f16 ? 10 : 7;
  const int bias = type == Type::f16 ? 15 : 127;
  int e;
  const double f = std::frexp(std::fabs(v), &e);  // |v| = f 2^e, f in [0.5, 1)
  const double scaled = std::ldexp(f, fraction_bits + 1);
  const int field = e - 1 + bias;
  if (scaled != std::floor(scaled) || field <= 0 || field >= (type == Type::f16 ? 31 : 255)) {
    throw std::logic_error("test bug: value not exactly representable");
  }
  const int fraction = int(scaled) - (1 << fraction_bits);
  return uint16_t((v < 0 ? 0x8000 : 0) | field << fraction_bits | fraction);
}

// A random normal value with exponent in [-3, 3] and every fraction bit random.
uint16_t random_bits(Type type, std::mt19937& rng) {
  const int fraction_bits = type == Type::f16 ? 10 : 7;
  const int bias = type == Type::f16 ? 15 : 127;
  const int exponent = std::uniform_int_distribution<int>(-3, 3)(rng);
  const int fraction = std::uniform_int_distribution<int>(0, (1 << fraction_bits) - 1)(rng);
  const int sign = std::uniform_int_distribution<int>(0, 1)(rng);
  return uint16_t(sign << 15 | (exponent + bias) << fraction_bits | fraction);
}

uint32_t pack(uint16_t low, uint16_t high) { return uint32_t(low) | uint32_t(high) << 16; }

const char* name(Type type) { return type == Type::bf16 ? "bf16" : "f16"; }

// A matrix of 16-bit patterns.
struct Matrix {
  Type type;
  int rows, cols;
  std::vector<uint16_t> bits;
  Matrix(Type t, int r, int c) : type(t), rows(r), cols(c), bits(size_t(r) * c, 0) {}
  uint16_t& at(int r, int c) { return bits.at(size_t(r) * cols + c); }
  uint16_t at(int r, int c) const { return bits.at(size_t(r) * cols + c); }
  double value(int r, int c) const { return reference_value(type, at(r, c)); }
  void randomize(std::mt19937& rng) {
    for (auto& b : bits) b = random_bits(type, rng);
  }
};

// --- shared memory -----------------------------------------------------------------------

struct Shared {
  std::vector<uint8_t> bytes;
  explicit Shared(size_t size) : bytes(size, 0) {}
  isa::Window window() const { return {bytes.data(), uint32_t(bytes.size())}; }
  void put(uint64_t address, uint16_t v) {
    bytes.at(address) = uint8_t(v & 0xFF);
    bytes.at(address + 1) = uint8_t(v >> 8);
  }
  uint16_t get(uint64_t address) const {
    return uint16_t(bytes.at(address) | bytes.at(address + 1) << 8);
  }
};

// ==========================================================================================
// 16-bit decoding
// ==========================================================================================

EMU_TEST(isa_to_float_f16_edge_cases) {
  struct Case {
    uint16_t bits;
    double value;
  } cases[] = {
      {0x0000, 0.0},
      {0x3C00, 1.0},
      {0xC000, -2.0},
      {0x3555, 0x1.554p-2},
      {0x7BFF, 65504.0},
      {0x0400, 0x1p-14},  // smallest normal
      {0x03FF, 0x1.ff8p-15} /* largest subnormal */,
      {0x0001, 0x1p-24},  // smallest subnormal
      {0x8001, -0x1p-24},
      {0x0200, 0x1p-15},
      {0xFBFF, -65504.0},
  };
  for (const Case& c : cases) {
    const float got = isa::to_float(Type::f16, c.bits);
    EMU_CHECK(double(got) == c.value, "f16 ", std::hex, c.bits, " decodes to ", got, ", want ",
              c.value);
  }
  EMU_CHECK(
      std::signbit(isa::to_float(Type::f16, 0x8000)) && isa::to_float(Type::f16, 0x8000) == 0.0f,
      "0x8000 is -0");
  EMU_CHECK(isa::to_float(Type::f16, 0x7C00) == std::numeric_limits<float>::infinity(),
            "0x7C00 is +inf");
  EMU_CHECK(isa::to_float(Type::f16, 0xFC00) == -std::numeric_limits<float>::infinity(),
            "0xFC00 is -inf");
  for (uint16_t nan : {uint16_t(0x7E00), uint16_t(0x7C01), uint16_t(0xFE00), uint16_t(0x7FFF)}) {
    EMU_CHECK(std::isnan(isa::to_float(Type::f16, nan)), "f16 ", std::hex, nan, " is a NaN");
  }
  // Every pattern against the ldexp decoder.
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const double want = reference_value(Type::f16, uint16_t(bits));
    const float got = isa::to_float(Type::f16, uint16_t(bits));
    const bool same = std::isnan(want)
                          ? std::isnan(got)
                          : (double(got) == want && std::signbit(got) == std::signbit(want));
    if (!same && ++mismatches <= 5)
      EMU_CHECK(same, "f16 ", std::hex, bits, ": got ", got, ", want ", want);
  }
  EMU_CHECK(mismatches == 0, mismatches, " f16 patterns decode wrongly");
}

EMU_TEST(isa_to_float_bf16) {
  EMU_CHECK(isa::to_float(Type::bf16, 0x3F80) == 1.0f);
  EMU_CHECK(isa::to_float(Type::bf16, 0xC0A0) == -5.0f);
  EMU_CHECK(isa::to_float(Type::bf16, 0x3EAB) == 0x1.56p-2f);
  EMU_CHECK(isa::to_float(Type::bf16, 0x7F7F) == 0x1.fep127f, "largest finite bf16");
  EMU_CHECK(isa::to_float(Type::bf16, 0x7F80) == std::numeric_limits<float>::infinity());
  EMU_CHECK(isa::to_float(Type::bf16, 0xFF80) == -std::numeric_limits<float>::infinity());
  EMU_CHECK(std::isnan(isa::to_float(Type::bf16, 0x7FC0)));
  EMU_CHECK(std::signbit(isa::to_float(Type::bf16, 0x8000)));
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const double want = reference_value(Type::bf16, uint16_t(bits));
    const float got = isa::to_float(Type::bf16, uint16_t(bits));
    const bool same = std::isnan(want) ? std::isnan(got) : double(got) == want;
    if (!same) ++mismatches;
  }
  EMU_CHECK(mismatches == 0, mismatches, " bf16 patterns decode wrongly");
}

// ==========================================================================================
// ldmatrix (ISA 9.7.14.5.15)
// ==========================================================================================

// Shared memory where the 16-bit element at byte address a holds a / 2: every element's
// value names its address.
Shared numbered(size_t size) {
  Shared s(size);
  for (size_t a = 0; a < size; a += 2) s.put(a, uint16_t(a / 2));
  return s;
}

// Row addresses: lane l gives row l % 8 of matrix l / 8, 32 distinct 16-byte rows scattered
// over the first 8 KiB.
void scattered_rows(uint32_t (&address)[32], std::mt19937& rng) {
  std::vector<uint32_t> rows(512);
  for (uint32_t i = 0; i < rows.size(); ++i) rows[i] = i;
  std::shuffle(rows.begin(), rows.end(), rng);
  for (int l = 0; l < 32; ++l) address[l] = 16 * rows[l];
}

EMU_TEST(isa_ldmatrix_x4_plain) {
  const Shared s = numbered(8192);
  std::mt19937 rng(1);
  for (int trial = 0; trial < 4; ++trial) {
    uint32_t address[32], out[32][4];
    scattered_rows(address, rng);
    isa::ldmatrix_x4(s.window(), address, false, out);
    // Figure 104: the 32 fragments of a matrix, two elements each, in row-major order, go to
    // lanes 0..31 (a group of four lanes per row); register i holds matrix i's fragment.
    for (int lane = 0; lane < 32; ++lane) {
      for (int i = 0; i < 4; ++i) {
        const int fragment = lane, row = fragment / 4, first = 2 * (fragment % 4);
        const uint32_t row_address = address[8 * i + row];
        const uint32_t want =
            pack(s.get(row_address + 2 * first), s.get(row_address + 2 * first + 2));
        EMU_CHECK(out[lane][i] == want, "lane ", lane, " register ", i, ": ", std::hex,
                  out[lane][i], " want ", want);
      }
    }
    const std::vector<isa::Range> reads = isa::ldmatrix_x4_reads(address);
    EMU_CHECK(reads.size() == 32, reads.size(), " ranges");
    for (int l = 0; l < 32 && l < int(reads.size()); ++l) {
      EMU_CHECK(reads[l].address == address[l] && reads[l].bytes == 16, "read ", l);
    }
  }
}

EMU_TEST(isa_ldmatrix_x4_trans) {
  const Shared s = numbered(8192);
  std::mt19937 rng(2);
  uint32_t address[32], out[32][4];
  scattered_rows(address, rng);
  isa::ldmatrix_x4(s.window(), address, true, out);
  // .trans: "the matrix is loaded in column-major format": lane l gets fragment l of the
  // transposed matrix, i.e. column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1 as stored.
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const int column = lane / 4, row = 2 * (lane % 4);
      const uint32_t want = pack(s.get(address[8 * i + row] + 2 * column),
                                 s.get(address[8 * i + row + 1] + 2 * column));
      EMU_CHECK(out[lane][i] == want, "lane ", lane, " register ", i, ": ", std::hex, out[lane][i],
                " want ", want);
    }
  }
}

EMU_TEST(isa_ldmatrix_x4_trans_is_plain_of_transpose) {
  // Four random 8 x 8 matrices stored row by row at scattered rows, and their transposes
  // stored the same way elsewhere: .trans of the first equals the plain load of the second.
  std::mt19937 rng(3);
  Shared s(16384);
  uint32_t rows_m[32], rows_t[32];
  std::vector<uint32_t> free_rows(1024);
  for (uint32_t i = 0; i < free_rows.size(); ++i) free_rows[i] = 16 * i;
  std::shuffle(free_rows.begin(), free_rows.end(), rng);
  for (int l = 0; l < 32; ++l) rows_m[l] = free_rows[l], rows_t[l] = free_rows[32 + l];
  for (int m = 0; m < 4; ++m) {
    for (int r = 0; r < 8; ++r) {
      for (int c = 0; c < 8; ++c) {
        const uint16_t v = uint16_t(rng());
        s.put(rows_m[8 * m + r] + 2 * c, v);
        s.put(rows_t[8 * m + c] + 2 * r, v);
      }
    }
  }
  uint32_t trans[32][4], plain[32][4];
  isa::ldmatrix_x4(s.window(), rows_m, true, trans);
  isa::ldmatrix_x4(s.window(), rows_t, false, plain);
  EMU_CHECK(std::memcmp(trans, plain, sizeof(trans)) == 0,
            ".trans of M differs from the plain load of M^T");
}

EMU_TEST(isa_ldmatrix_x4_rejects_bad_addresses) {
  const Shared s = numbered(4096);
  uint32_t address[32], out[32][4];
  for (int l = 0; l < 32; ++l) address[l] = 64 * l;
  isa::ldmatrix_x4(s.window(), address, false, out);  // fine
  for (uint32_t misalignment : {2u, 4u, 8u}) {
    uint32_t bad[32];
    std::copy(address, address + 32, bad);
    bad[13] += misalignment;
    EMU_CHECK_THROWS(isa::ldmatrix_x4(s.window(), bad, false, out), "not 16-byte aligned");
    EMU_CHECK_THROWS(isa::ldmatrix_x4(s.window(), bad, true, out), "lane 13");
    EMU_CHECK_THROWS(isa::ldmatrix_x4_reads(bad), "not 16-byte aligned");
  }
  uint32_t outside[32];
  std::copy(address, address + 32, outside);
  outside[31] = 4096;
  EMU_CHECK_THROWS(isa::ldmatrix_x4(s.window(), outside, false, out), "outside shared memory");
  outside[31] = 4096 - 16;
  isa::ldmatrix_x4(s.window(), outside, false, out);  // the last row of the window is fine
}

// ==========================================================================================
// mma.sync m16n8k16 (ISA 9.7.14.5.8), the documented fragment tables transcribed
// ==========================================================================================

// A: "row = groupID for ai where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
//     col = (threadID_in_group * 2) + (i & 0x1) for ai where i < 4, ... + 8 for i >= 4"
int doc_a_row(int lane, int i) {
  return (i < 2 || (4 <= i && i < 6)) ? lane >> 2 : (lane >> 2) + 8;
}
int doc_a_col(int lane, int i) {
  return i < 4 ? (lane % 4) * 2 + (i & 1) : (lane % 4) * 2 + (i & 1) + 8;
}
// B: "row = (threadID_in_group * 2) + (i & 0x1) for bi where i < 2, ... + 8 for i >= 2;
//     col = groupID"
int doc_b_row(int lane, int i) {
  return i < 2 ? (lane % 4) * 2 + (i & 1) : (lane % 4) * 2 + (i & 1) + 8;
}
int doc_b_col(int lane, int) { return lane >> 2; }
// C/D: "row = groupID for ci where i < 2, groupID + 8 for ci where i >= 2;
//       col = (threadID_in_group * 2) + (i & 0x1)"
int doc_c_row(int lane, int i) { return i < 2 ? lane >> 2 : (lane >> 2) + 8; }
int doc_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

// Fragments of matrices: element i of a fragment is in register i / 2, low half if i even.
void fragment_a(const Matrix& A, uint32_t (&a)[32][4]) {
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r)
      a[lane][r] = pack(A.at(doc_a_row(lane, 2 * r), doc_a_col(lane, 2 * r)),
                        A.at(doc_a_row(lane, 2 * r + 1), doc_a_col(lane, 2 * r + 1)));
}
void fragment_b(const Matrix& B, uint32_t (&b)[32][2]) {
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 2; ++r)
      b[lane][r] = pack(B.at(doc_b_row(lane, 2 * r), doc_b_col(lane, 2 * r)),
                        B.at(doc_b_row(lane, 2 * r + 1), doc_b_col(lane, 2 * r + 1)));
}

EMU_TEST(isa_mma_fragment_tables_cover_each_element_once) {
  int a_hits[16][16] = {}, b_hits[16][8] = {}, c_hits[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) ++a_hits[doc_a_row(lane, i)][doc_a_col(lane, i)];
    for (int i = 0; i < 4; ++i) ++b_hits[doc_b_row(lane, i)][doc_b_col(lane, i)];
    for (int i = 0; i < 4; ++i) ++c_hits[doc_c_row(lane, i)][doc_c_col(lane, i)];
  }
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) EMU_CHECK(a_hits[r][c] == 1, "A ", r, ",", c);
    for (int c = 0; c < 8; ++c)
      EMU_CHECK(b_hits[r][c] == 1 && c_hits[r][c] == 1, "B/C ", r, ",", c);
  }
}

EMU_TEST(isa_mma_one_hot) {
  // A = 2 at (row, k) only, B = 3 at (k, col) only: D = C + 6 exactly at the documented lane
  // and register of (row, col) and D = C everywhere else, for every row, col and k.
  for (Type type : {Type::bf16, Type::f16}) {
    for (int row = 0; row < 16; ++row) {
      for (int col = 0; col < 8; ++col) {
        for (int k = 0; k < 16; ++k) {
          Matrix A(type, 16, 16), B(type, 16, 8);
          A.at(row, k) = encode(type, 2.0);
          B.at(k, col) = encode(type, 3.0);
          uint32_t a[32][4], b[32][2];
          fragment_a(A, a);
          fragment_b(B, b);
          float c[32][4];
          for (int lane = 0; lane < 32; ++lane)
            for (int i = 0; i < 4; ++i) c[lane][i] = 0.25f * float(4 * lane + i);
          isa::mma_m16n8k16(type, a, b, c);
          for (int lane = 0; lane < 32; ++lane) {
            for (int i = 0; i < 4; ++i) {
              const bool hit = doc_c_row(lane, i) == row && doc_c_col(lane, i) == col;
              const float want = 0.25f * float(4 * lane + i) + (hit ? 6.0f : 0.0f);
              EMU_CHECK(c[lane][i] == want, name(type), " one-hot A(", row, ",", k, ") B(", k, ",",
                        col, "): lane ", lane, " c", i, " = ", c[lane][i], ", want ", want);
            }
          }
        }
      }
    }
    // The same spots in words: (row, col) lives in lane 4 (row % 8) + col / 2, register
    // (col % 2) + 2 (row / 8).
    for (int row = 0; row < 16; ++row)
      for (int col = 0; col < 8; ++col) {
        const int lane = 4 * (row % 8) + col / 2, i = col % 2 + 2 * (row / 8);
        EMU_CHECK(doc_c_row(lane, i) == row && doc_c_col(lane, i) == col);
      }
  }
}

// D = A B + C in double.
std::vector<double> reference_product(const Matrix& A, const Matrix& B,
                                      const std::vector<double>& C, bool accumulate,
                                      std::vector<double>* magnitude) {
  std::vector<double> D(size_t(A.rows) * B.cols);
  if (magnitude) magnitude->assign(D.size(), 0.0);
  for (int r = 0; r < A.rows; ++r) {
    for (int c = 0; c < B.cols; ++c) {
      double sum = accumulate ? C[size_t(r) * B.cols + c] : 0.0, size = std::fabs(sum);
      for (int k = 0; k < A.cols; ++k) {
        sum += A.value(r, k) * B.value(k, c);
        size += std::fabs(A.value(r, k) * B.value(k, c));
      }
      D[size_t(r) * B.cols + c] = sum;
      if (magnitude) (*magnitude)[size_t(r) * B.cols + c] = size;
    }
  }
  return D;
}

// Within float accumulation's error of the double result: 17 terms, each addition rounding
// by at most 2^-24 relative to the running magnitude.
bool close(double got, double want, double magnitude) {
  return std::fabs(got - want) <= 2e-6 * magnitude + 1e-30;
}

EMU_TEST(isa_mma_random) {
  std::mt19937 rng(4);
  for (Type type : {Type::bf16, Type::f16}) {
    for (int trial = 0; trial < 20; ++trial) {
      Matrix A(type, 16, 16), B(type, 16, 8);
      A.randomize(rng);
      B.randomize(rng);
      std::vector<double> C(16 * 8);
      float c[32][4];
      std::normal_distribution<float> normal(0.0f, 4.0f);
      for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < 4; ++i)
          C[doc_c_row(lane, i) * 8 + doc_c_col(lane, i)] = c[lane][i] = normal(rng);
      uint32_t a[32][4], b[32][2];
      fragment_a(A, a);
      fragment_b(B, b);
      std::vector<double> magnitude;
      const std::vector<double> D = reference_product(A, B, C, true, &magnitude);
      isa::mma_m16n8k16(type, a, b, c);
      for (int lane = 0; lane < 32; ++lane) {
        for (int i = 0; i < 4; ++i) {
          const int at = doc_c_row(lane, i) * 8 + doc_c_col(lane, i);
          EMU_CHECK(close(c[lane][i], D[at], magnitude[at]), name(type), " trial ", trial, " lane ",
                    lane, " c", i, " = ", c[lane][i], ", want ", D[at]);
        }
      }
    }
  }
}

EMU_TEST(isa_mma_small_integers_exact) {
  // Small integers: every product and partial sum is exact, so D must equal the reference.
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> small(-16, 16);
  for (Type type : {Type::bf16, Type::f16}) {
    Matrix A(type, 16, 16), B(type, 16, 8);
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) A.at(r, c) = encode(type, small(rng));
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 8; ++c) B.at(r, c) = encode(type, small(rng));
    uint32_t a[32][4], b[32][2];
    fragment_a(A, a);
    fragment_b(B, b);
    float c[32][4] = {};
    isa::mma_m16n8k16(type, a, b, c);
    const std::vector<double> D =
        reference_product(A, B, std::vector<double>(128, 0.0), false, nullptr);
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const double want = D[doc_c_row(lane, i) * 8 + doc_c_col(lane, i)];
        EMU_CHECK(c[lane][i] == want, name(type), " lane ", lane, " c", i, " = ", c[lane][i],
                  ", want ", want);
      }
  }
}

// ==========================================================================================
// wgmma matrix descriptors and shared-memory layouts (ISA 9.7.15.5.1.2)
// ==========================================================================================

// The descriptor of ISA 9.7.15.5.1.2.2, built field by field.
uint64_t make_descriptor(uint32_t start, uint32_t leading_bytes, uint32_t stride_bytes,
                         int swizzle = 1, uint32_t base_offset = 0) {
  auto encode14 = [](uint32_t x) { return uint64_t((x & 0x3FFFF) >> 4); };
  return encode14(start) | encode14(leading_bytes) << 16 | encode14(stride_bytes) << 32 |
         uint64_t(base_offset & 7) << 49 | uint64_t(swizzle & 3) << 62;
}

EMU_TEST(isa_wgmma_descriptor_decode) {
  // start 0x2340, LBO 4096, SBO 1024, base offset 5, 128-byte swizzle, written as raw bits.
  const uint64_t raw = 0x234ull | 0x100ull << 16 | 0x40ull << 32 | 5ull << 49 | 1ull << 62;
  isa::Descriptor d = isa::decode(raw);
  EMU_CHECK(d.start == 0x2340 && d.leading_bytes == 4096 && d.stride_bytes == 1024 &&
                d.base_offset == 5 && d.swizzle == 1,
            "start ", d.start, " lbo ", d.leading_bytes, " sbo ", d.stride_bytes, " base ",
            d.base_offset, " swizzle ", d.swizzle);
  // The bits that are no field (15-14, 31-30, 48-46, 61-52) change nothing.
  const uint64_t junk = 0x3ull << 14 | 0x3ull << 30 | 0x7ull << 46 | 0x3FFull << 52;
  isa::Descriptor e = isa::decode(raw | junk);
  EMU_CHECK(e.start == d.start && e.leading_bytes == d.leading_bytes &&
            e.stride_bytes == d.stride_bytes && e.base_offset == d.base_offset &&
            e.swizzle == d.swizzle);
  // Field extremes and the other swizzle modes.
  isa::Descriptor f =
      isa::decode(0x3FFFull | 0x3FFFull << 16 | 0x3FFFull << 32 | 7ull << 49 | 3ull << 62);
  EMU_CHECK(f.start == 0x3FFF0 && f.leading_bytes == 0x3FFF0 && f.stride_bytes == 0x3FFF0 &&
            f.base_offset == 7 && f.swizzle == 3);
  EMU_CHECK(isa::decode(2ull << 62).swizzle == 2 && isa::decode(0).swizzle == 0);
  // make_descriptor (the ISA's matrix-descriptor-encode) round-trips.
  isa::Descriptor g = isa::decode(make_descriptor(0x1F400, 16, 2048, 1));
  EMU_CHECK(g.start == 0x1F400 && g.leading_bytes == 16 && g.stride_bytes == 2048 &&
            g.swizzle == 1 && g.base_offset == 0);
}

// Table 38 / Figure 157, K-major 128-byte swizzle, as a placement rule: the atom is 8 rows (8
// consecutive m or n) of 128 bytes; row r holds 64 consecutive k as eight 16-byte chunks, and
// chunk c (k 8c .. 8c + 7) of row r is stored at chunk position c ^ r. 8-row groups are
// group_bytes apart; 64-wide panels of k are panel_bytes apart. tile must be 1024-aligned.
uint32_t kmajor_place(uint32_t tile, uint32_t group_bytes, uint32_t panel_bytes, int mn, int kk) {
  const int r = mn % 8, c = (kk % 64) / 8;
  return tile + (kk / 64) * panel_bytes + (mn / 8) * group_bytes + r * 128 + ((c ^ r) * 16) +
         (kk % 8) * 2;
}

// Table 38 / Figure 156, MN-major 128-byte swizzle: the atom is 8 rows (8 consecutive k) of
// 128 bytes; row r holds 64 consecutive m or n as eight chunks, chunk c (mn 8c .. 8c + 7) at
// position c ^ r. Atoms along MN are atom_bytes apart, groups of 8 k group_bytes apart.
uint32_t mnmajor_place(uint32_t tile, uint32_t atom_bytes, uint32_t group_bytes, int mn, int kk) {
  const int r = kk % 8, c = (mn % 64) / 8;
  return tile + (mn / 64) * atom_bytes + (kk / 8) * group_bytes + r * 128 + ((c ^ r) * 16) +
         (mn % 8) * 2;
}

// A CuTe layout mode: a coordinate is split over shape (first entry fastest) and the parts
// weighted by stride. Used to evaluate the ISA's canonical layouts literally.
struct Mode {
  std::vector<int> shape, stride;
  int64_t operator()(int coordinate) const {
    int64_t offset = 0;
    for (size_t i = 0; i < shape.size(); ++i) {
      const bool last = i + 1 == shape.size();
      offset += int64_t(last ? coordinate : coordinate % shape[i]) * stride[i];
      coordinate /= shape[i];
    }
    return offset;
  }
};

// CuTe's Swizzle<B, 4, 3> on a byte address: bits [4, 4 + B) ^= bits [7, 7 + B).
uint32_t cute_swizzle(int B, uint32_t address) {
  return address ^ (((address >> 7) & ((1u << B) - 1)) << 4);
}

// Element (mn, k) of a 16-bit operand in "Swizzle<B,4,3> o smem_ptr o (mn_mode, k_mode)" (in
// elements) starting at byte address start.
uint32_t canonical(int B, const Mode& mn_mode, const Mode& k_mode, uint32_t start, int mn, int k) {
  return cute_swizzle(B, uint32_t(start + 2 * (mn_mode(mn) + k_mode(k))));
}

EMU_TEST(isa_wgmma_kmajor_128b_addresses) {
  // Tiles of 128 rows x 128 k at 1024-aligned addresses, with dense and with padded 8-row
  // groups; every k16 step s: start = panel (s / 4) + 32 (s % 4) bytes, SBO = group stride.
  struct Config {
    uint32_t tile, group_bytes;
  } configs[] = {{0, 1024}, {3 * 1024, 1024}, {5 * 1024, 3072}};
  for (const Config& cfg : configs) {
    const uint32_t panel_bytes = 16 * cfg.group_bytes;  // 128 rows
    for (int s = 0; s < 8; ++s) {
      const uint32_t start = cfg.tile + (s / 4) * panel_bytes + (s % 4) * 32;
      const isa::Descriptor d = isa::decode(make_descriptor(start, 16, cfg.group_bytes));
      // The canonical layout ((8,m),(T,2k)):((8T,SBO),(1,T)), T = 8, in elements.
      const Mode mn_mode{{8, 16}, {64, int(cfg.group_bytes / 2)}}, k_mode{{8, 2}, {1, 8}};
      for (int mn = 0; mn < 128; ++mn) {
        for (int k = 0; k < 16; ++k) {
          const uint32_t got = isa::operand_address(d, false, mn, k);
          const uint32_t table =
              kmajor_place(cfg.tile, cfg.group_bytes, panel_bytes, mn, 16 * s + k);
          const uint32_t doc = canonical(3, mn_mode, k_mode, start, mn, k);
          EMU_CHECK(got == table && got == doc, "tile ", cfg.tile, " SBO ", cfg.group_bytes,
                    " step ", s, " (mn ", mn, ", k ", k, "): operand_address ", got,
                    ", Table 38 placement ", table, ", canonical layout ", doc);
        }
      }
    }
  }
}

EMU_TEST(isa_wgmma_mnmajor_128b_addresses) {
  // B tiles of 32 k x 192 n (three 64-wide atoms along n): atoms along n after all the k
  // (the kernels' panels, LBO = 4 x 1024) or interleaved with the k groups (LBO = 1024,
  // SBO = 3072); k16 step s starts 2 SBO further.
  struct Config {
    uint32_t tile, atom_bytes, group_bytes;
  } configs[] = {{0, 4096, 1024}, {2048, 4096, 1024}, {1024, 1024, 3072}};
  for (const Config& cfg : configs) {
    for (int s = 0; s < 2; ++s) {
      const uint32_t start = cfg.tile + 2 * s * cfg.group_bytes;
      const isa::Descriptor d =
          isa::decode(make_descriptor(start, cfg.atom_bytes, cfg.group_bytes));
      // The canonical layout ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)), T = 8, in elements.
      const Mode mn_mode{{8, 8, 3}, {1, 8, int(cfg.atom_bytes / 2)}},
          k_mode{{8, 2}, {64, int(cfg.group_bytes / 2)}};
      for (int mn = 0; mn < 192; ++mn) {
        for (int k = 0; k < 16; ++k) {
          const uint32_t got = isa::operand_address(d, true, mn, k);
          const uint32_t table =
              mnmajor_place(cfg.tile, cfg.atom_bytes, cfg.group_bytes, mn, 16 * s + k);
          const uint32_t doc = canonical(3, mn_mode, k_mode, start, mn, k);
          EMU_CHECK(got == table && got == doc, "tile ", cfg.tile, " LBO ", cfg.atom_bytes, " SBO ",
                    cfg.group_bytes, " step ", s, " (mn ", mn, ", k ", k, "): operand_address ",
                    got, ", Table 38 placement ", table, ", canonical layout ", doc);
        }
      }
    }
  }
}

EMU_TEST(isa_wgmma_documented_examples_other_modes) {
  // The worked examples of 9.7.15.5.1.2.1.3 ("Exact layout", in elements, with their LBO and
  // SBO), evaluated literally. The MN-major ones are bf16 as printed; the K-major ones are
  // printed for tf32 (4 elements per 16 bytes) and are carried over to 16-bit elements by
  // doubling the contiguous extent (Table 38: shapes scale along the leading dimension by
  // 128 / element bits), keeping every byte offset.
  const uint32_t start = 8192;
  struct Example {
    const char* what;
    bool mn_major;
    int swizzle_mode, B;
    Mode mn_mode, k_mode;
    uint32_t lbo, sbo;
    int mn_extent;
  } examples[] = {
      // MN-major, no swizzling, bf16: ((8,1,2),(8,2)):((1,8,64),(8,128)), LBO 128, SBO 64 elements.
      {"MN-major no swizzle",
       true,
       0,
       0,
       {{8, 1, 2}, {1, 8, 64}},
       {{8, 2}, {8, 128}},
       256,
       128,
       16},
      // MN-major, 32B: ((8,2,2),(8,2)):((1,8,128),(16,256)), LBO 128, SBO 256 elements.
      {"MN-major 32B", true, 3, 1, {{8, 2, 2}, {1, 8, 128}}, {{8, 2}, {16, 256}}, 256, 512, 32},
      // MN-major, 64B: ((8,4,2),(8,2)):((1,8,256),(32,512)), LBO 256, SBO 512 elements.
      {"MN-major 64B", true, 2, 2, {{8, 4, 2}, {1, 8, 256}}, {{8, 2}, {32, 512}}, 512, 1024, 64},
      // K-major, no swizzling, tf32: ((8,2),(4,4)):((4,32),(1,64)), LBO 64, SBO 32 tf32;
      // in 16-bit elements ((8,2),(8,2)):((8,64),(1,128)), LBO 256 bytes, SBO 128 bytes.
      {"K-major no swizzle", false, 0, 0, {{8, 2}, {8, 64}}, {{8, 2}, {1, 128}}, 256, 128, 16},
      // K-major, 32B, tf32: ((8,2),(4,4)):((8,64),(1,4)), SBO 64 tf32, LBO unused;
      // in 16-bit elements ((8,2),(8,2)):((16,128),(1,8)), SBO 256 bytes.
      {"K-major 32B", false, 3, 1, {{8, 2}, {16, 128}}, {{8, 2}, {1, 8}}, 16, 256, 16},
  };
  for (const Example& ex : examples) {
    const isa::Descriptor d = isa::decode(make_descriptor(start, ex.lbo, ex.sbo, ex.swizzle_mode));
    for (int mn = 0; mn < ex.mn_extent; ++mn) {
      for (int k = 0; k < 16; ++k) {
        const uint32_t got = isa::operand_address(d, ex.mn_major, mn, k);
        const uint32_t want = canonical(ex.B, ex.mn_mode, ex.k_mode, start, mn, k);
        EMU_CHECK(got == want, ex.what, " (mn ", mn, ", k ", k, "): ", got, ", want ", want);
      }
    }
  }
  // 64B K-major from its canonical layout ((8,m),(T,2k)):((4T,SBO),(1,T)) with SBO 512.
  const isa::Descriptor d = isa::decode(make_descriptor(start + 32, 16, 512, 2));
  const Mode mn_mode{{8, 8}, {32, 256}}, k_mode{{8, 2}, {1, 8}};
  for (int mn = 0; mn < 64; ++mn)
    for (int k = 0; k < 16; ++k) {
      const uint32_t got = isa::operand_address(d, false, mn, k),
                     want = canonical(2, mn_mode, k_mode, start + 32, mn, k);
      EMU_CHECK(got == want, "K-major 64B (mn ", mn, ", k ", k, "): ", got, ", want ", want);
    }
}

EMU_TEST(isa_wgmma_reads) {
  // K-major A, 64 rows, SBO 1024 at 4096: each row's two chunks (32 bytes, swizzled but
  // adjacent), 64 ranges of 32 bytes.
  const uint64_t a = make_descriptor(4096 + 64, 16, 1024);
  const std::vector<isa::Range> ra = isa::wgmma_reads(a, false, 64);
  std::set<uint32_t> want_chunks, got_chunks;
  const isa::Descriptor da = isa::decode(a);
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < 16; ++k) want_chunks.insert(isa::operand_address(da, false, m, k) & ~15u);
  uint64_t total = 0;
  for (const isa::Range& r : ra) {
    total += r.bytes;
    EMU_CHECK(r.address % 16 == 0 && r.bytes % 16 == 0);
    for (uint32_t c = r.address; c < r.address + r.bytes; c += 16) got_chunks.insert(c);
  }
  EMU_CHECK(total == 64 * 32, "K-major reads ", total, " bytes");
  EMU_CHECK(got_chunks == want_chunks, "K-major reads are not the operand's chunks");
  for (size_t i = 1; i < ra.size(); ++i)
    EMU_CHECK(ra[i - 1].address + ra[i - 1].bytes < ra[i].address, "unmerged");
  // MN-major B, N = 64, SBO 1024: two whole 1024-byte atoms, adjacent, so one range.
  const std::vector<isa::Range> rb = isa::wgmma_reads(make_descriptor(8192, 8192, 1024), true, 64);
  EMU_CHECK(rb.size() == 1 && rb[0].address == 8192 && rb[0].bytes == 2048, rb.size(), " ranges");
  // MN-major B, N = 128, LBO 4096, SBO 2048: four atoms.
  const std::vector<isa::Range> rc = isa::wgmma_reads(make_descriptor(8192, 4096, 2048), true, 128);
  EMU_CHECK(rc.size() == 4 && rc[0].address == 8192 && rc[1].address == 8192 + 2048 &&
            rc[2].address == 8192 + 4096 && rc[3].address == 8192 + 6144 && rc[3].bytes == 1024);
  EMU_CHECK_THROWS(isa::wgmma_reads(a, false, 12), "multiple of 8");
}

EMU_TEST(isa_wgmma_descriptor_checks) {
  auto address = [](uint64_t desc, bool mn_major, int mn, int k) {
    return isa::operand_address(isa::decode(desc), mn_major, mn, k);
  };
  // Patterns must start on a 1024-byte boundary (base offset 0).
  EMU_CHECK_THROWS(address(make_descriptor(1024 + 512, 16, 1024), false, 0, 0),
                   "1024-byte boundary");
  EMU_CHECK_THROWS(address(make_descriptor(1024 + 128, 8192, 1024), true, 0, 0),
                   "1024-byte boundary");
  // A non-zero base offset is not implemented.
  EMU_CHECK_THROWS(address(make_descriptor(1024 + 512, 16, 1024, 1, 4), false, 0, 0),
                   "base offset");
  // K-major: the k16 step must stay in the 128-byte row; the LBO is unused (0 or 16 only).
  EMU_CHECK_THROWS(address(make_descriptor(1024 + 112, 16, 1024), false, 0, 0), "leave the row");
  address(make_descriptor(1024 + 96, 16, 1024), false, 0, 15);
  address(make_descriptor(1024 + 96, 0, 1024), false, 9, 15);
  EMU_CHECK_THROWS(address(make_descriptor(1024, 1024, 1024), false, 0, 0), "unused");
  // Strides must keep atoms on pattern boundaries.
  EMU_CHECK_THROWS(address(make_descriptor(1024, 16, 1536), false, 8, 0), "stride byte offset");
  EMU_CHECK_THROWS(address(make_descriptor(1024, 1536, 1024), true, 64, 0), "leading byte offset");
  EMU_CHECK_THROWS(address(make_descriptor(1024, 1024, 1536), true, 0, 8), "stride byte offset");
  // MN-major: the mn read must stay in the row.
  address(make_descriptor(1024 + 112, 1024, 1024), true, 7, 0);
  EMU_CHECK_THROWS(address(make_descriptor(1024 + 112, 1024, 1024), true, 8, 0), "leave the row");
  // Indices.
  EMU_CHECK_THROWS(address(make_descriptor(1024, 16, 1024), false, 0, 16), "k = 16");
  EMU_CHECK_THROWS(address(make_descriptor(1024, 16, 1024), false, -1, 0), "mn = -1");
}

// ==========================================================================================
// wgmma.mma_async m64nNk16 (ISA 9.7.15.5.2, fragments 9.7.15.5.1.1.1)
// ==========================================================================================

// Figures 148 and 149 (the warpgroup's warp w = t / 32 owns rows 16 w .. 16 w + 15, laid out
// as mma.m16n8k16's A and C fragments, D's registers 4 j .. 4 j + 3 covering columns
// 8 j .. 8 j + 7).
int wg_row(int t, int i) { return 16 * (t / 32) + doc_c_row(t % 32, i % 4); }
int wg_a_col(int t, int i) { return doc_a_col(t % 32, i); }
int wg_a_row(int t, int i) { return 16 * (t / 32) + doc_a_row(t % 32, i); }
int wg_d_col(int t, int i) { return 8 * (i / 4) + doc_c_col(t % 32, i % 4); }

struct Accumulators {
  int n;
  std::vector<std::vector<float>> regs;
  float* pointers[128];
  std::vector<std::pair<int, int>> owner;  // (thread, register) of each (row, col)
  explicit Accumulators(int n_)
      : n(n_), regs(128, std::vector<float>(size_t(n_ / 2), 0.0f)), owner(size_t(64) * n_) {
    for (int t = 0; t < 128; ++t) {
      pointers[t] = regs[t].data();
      for (int i = 0; i < n / 2; ++i) owner.at(size_t(wg_row(t, i)) * n + wg_d_col(t, i)) = {t, i};
    }
  }
  float& at(int row, int col) {  // by matrix position, through the documented map
    const auto& o = owner.at(size_t(row) * n + col);
    return regs[o.first][o.second];
  }
};

// A (64 x 16) as thread fragments (Figure 148).
std::vector<std::array<uint32_t, 4>> a_fragments(const Matrix& A) {
  std::vector<std::array<uint32_t, 4>> regs(128);
  for (int t = 0; t < 128; ++t)
    for (int r = 0; r < 4; ++r)
      regs[t][r] = pack(A.at(wg_a_row(t, 2 * r), wg_a_col(t, 2 * r)),
                        A.at(wg_a_row(t, 2 * r + 1), wg_a_col(t, 2 * r + 1)));
  return regs;
}

// Where the operands go in a test's shared memory (64 KiB), all 1024-aligned.
constexpr uint32_t kShared = 131072;
constexpr uint32_t kTileA = 4096;   // A: K-major, 64 rows x up to 128 k (two 8 KiB panels)
constexpr uint32_t kTileB = 32768;  // B: K-major N rows x up to 128 k, or MN-major up to 128 k x N

// Stores A (64 x K) K-major at kTileA + shift with SBO 1024, panels of 64 k 8192 apart.
void store_a(Shared& s, const Matrix& A, uint32_t shift = 0) {
  for (int m = 0; m < A.rows; ++m)
    for (int k = 0; k < A.cols; ++k)
      s.put(kmajor_place(kTileA + shift, 1024, 8192, m, k), A.at(m, k));
}
uint64_t a_step(int step, uint32_t shift = 0, uint32_t sbo = 1024, uint32_t lbo = 16) {
  return make_descriptor(kTileA + shift + (step / 4) * 8192 + (step % 4) * 32, lbo, sbo);
}

// Stores B (K x N) K-major (row n holds the k), SBO 1024, panels of 64 k N*128 apart.
void store_b_kmajor(Shared& s, const Matrix& B) {
  for (int k = 0; k < B.rows; ++k)
    for (int n = 0; n < B.cols; ++n)
      s.put(kmajor_place(kTileB, 1024, B.cols * 128, n, k), B.at(k, n));
}
uint64_t b_kmajor_step(int n, int step) {
  return make_descriptor(kTileB + (step / 4) * n * 128 + (step % 4) * 32, 16, 1024);
}

// Stores B (K x N) MN-major: 64-wide atoms along n K * 128 bytes apart (the kernels' panels),
// groups of 8 k 1024 apart.
void store_b_mnmajor(Shared& s, const Matrix& B) {
  for (int k = 0; k < B.rows; ++k)
    for (int n = 0; n < B.cols; ++n)
      s.put(mnmajor_place(kTileB, B.rows * 128, 1024, n, k), B.at(k, n));
}
uint64_t b_mnmajor_step(int k_total, int step, uint32_t lbo = 0, uint32_t sbo = 1024) {
  return make_descriptor(kTileB + step * 2 * sbo, lbo ? lbo : k_total * 128, sbo);
}

// Columns [16 s, 16 s + 16) of A, rows [16 s, 16 s + 16) of B.
Matrix k_slice(const Matrix& M, int step, bool columns) {
  Matrix out(M.type, columns ? M.rows : 16, columns ? 16 : M.cols);
  for (int r = 0; r < out.rows; ++r)
    for (int c = 0; c < out.cols; ++c)
      out.at(r, c) = columns ? M.at(r, 16 * step + c) : M.at(16 * step + r, c);
  return out;
}

enum class Form { ss_kmajor_b, ss_mnmajor_b, rs_mnmajor_b };
const char* form_name(Form f) {
  return f == Form::ss_kmajor_b    ? "SS, B K-major"
         : f == Form::ss_mnmajor_b ? "SS, B MN-major"
                                   : "RS, B MN-major";
}

// Stores A (64 x K, K-major) and B (K x N, as `form` reads it) in shared memory.
void store_operands(Shared& s, Form form, const Matrix& A, const Matrix& B) {
  store_a(s, A);
  if (form == Form::ss_kmajor_b)
    store_b_kmajor(s, B);
  else
    store_b_mnmajor(s, B);
}

// Issues k16 step `step` of D (+)= A B in `form`, the operands as store_operands puts them:
// A through a_step's descriptor, or for RS from registers (its k16 columns as fragments);
// B through its layout's descriptor.
void wgmma_step(Form form, Type type, const Matrix& A, const Matrix& B, int step, int scale_d,
                const Shared& s, Accumulators& acc) {
  const int n = B.cols;
  const uint64_t bd =
      form == Form::ss_kmajor_b ? b_kmajor_step(n, step) : b_mnmajor_step(B.rows, step);
  if (form == Form::rs_mnmajor_b) {
    const auto regs = a_fragments(k_slice(A, step, true));
    isa::wgmma(type, n, reinterpret_cast<const uint32_t (*)[4]>(regs.data()), 0, bd, true,
               scale_d, s.window(), acc.pointers);
  } else {
    isa::wgmma(type, n, nullptr, a_step(step), bd, form == Form::ss_mnmajor_b, scale_d,
               s.window(), acc.pointers);
  }
}

// Runs D (+)= A B over K / 16 k16 steps as a kernel would (the first step with scale_d =
// first_scale_d, the others accumulating) and returns the largest error relative to the
// float-accumulation bound (<= 1 passes); D starts from d0.
double run_product(Form form, Type type, const Matrix& A, const Matrix& B,
                   const std::vector<double>& d0, int first_scale_d, std::string* where) {
  const int n = B.cols, steps = A.cols / 16;
  Shared s(kShared);
  store_operands(s, form, A, B);
  Accumulators acc(n);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < n; ++c) acc.at(r, c) = float(d0[size_t(r) * n + c]);
  for (int step = 0; step < steps; ++step)
    wgmma_step(form, type, A, B, step, step == 0 ? first_scale_d : 1, s, acc);
  std::vector<double> magnitude;
  const std::vector<double> want = reference_product(A, B, d0, first_scale_d != 0, &magnitude);
  double worst = 0;
  for (int t = 0; t < 128; ++t)
    for (int i = 0; i < n / 2; ++i) {
      const size_t at = size_t(wg_row(t, i)) * n + wg_d_col(t, i);
      const double err = std::fabs(acc.regs[t][i] - want[at]) / (2e-6 * (magnitude[at] + 1e-30));
      if (!(err <= worst)) {
        worst = std::isnan(err) ? std::numeric_limits<double>::infinity() : err;
        if (where) {
          *where = emu_test::concat("thread ", t, " d", i, " (row ", wg_row(t, i), ", col ",
                                    wg_d_col(t, i), ") = ", acc.regs[t][i], ", want ", want[at]);
        }
      }
    }
  return worst;
}

// One k16 step, D = A B (scale_d 0) with A 64 x 16 and B 16 x N laid out by `store` and read
// through the given descriptors (A from registers when a_regs is given): the largest error
// relative to the float-accumulation bound, or the exception's message.
struct Outcome {
  bool threw = false;
  std::string message;
  double worst = 0;
};

template <typename Store>
Outcome try_step(Type type, const Matrix& A, const Matrix& B, Store&& store, uint64_t a_desc,
                 uint64_t b_desc, bool b_mn_major, bool a_from_registers = false) {
  Shared s(kShared);
  store(s);
  Accumulators acc(B.cols);
  const auto regs = a_fragments(A);
  Outcome out;
  try {
    isa::wgmma(type, B.cols,
               a_from_registers ? reinterpret_cast<const uint32_t (*)[4]>(regs.data()) : nullptr,
               a_desc, b_desc, b_mn_major, 0, s.window(), acc.pointers);
  } catch (const std::invalid_argument& e) {
    out.threw = true;
    out.message = e.what();
    return out;
  }
  std::vector<double> magnitude;
  const std::vector<double> want = reference_product(A, B, {}, false, &magnitude);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < B.cols; ++c) {
      const size_t at = size_t(r) * B.cols + c;
      const double err = std::fabs(acc.at(r, c) - want[at]) / (2e-6 * magnitude[at] + 1e-30);
      out.worst =
          std::max(out.worst, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
    }
  return out;
}

Matrix random_matrix(Type type, int rows, int cols, std::mt19937& rng) {
  Matrix m(type, rows, cols);
  m.randomize(rng);
  return m;
}

// Random A (64 x 16) and B (16 x N), and shared memory holding them as `form` reads them:
// the operands of one k16 step.
struct StepOperands {
  Matrix A, B;
  Shared s;
  StepOperands(Type type, int n, Form form, std::mt19937& rng)
      : A(random_matrix(type, 64, 16, rng)), B(random_matrix(type, 16, n, rng)), s(kShared) {
    store_operands(s, form, A, B);
  }
};

EMU_TEST(isa_wgmma_accumulator_layout) {
  // A[m][0] = m, A[m][1] = 1, B[0][n] = 1, B[1][n] = 64 n, all else 0: D[m][n] = m + 64 n
  // exactly, which names the element each accumulator register holds (Figure 149). The
  // accumulators start as NaN: scale_d = 0 must overwrite them.
  for (Type type : {Type::bf16, Type::f16}) {
    for (int n : {8, 16, 64, 128, 256}) {
      Matrix A(type, 64, 16), B(type, 16, n);
      for (int m = 0; m < 64; ++m) A.at(m, 0) = encode(type, m), A.at(m, 1) = encode(type, 1);
      for (int c = 0; c < n; ++c) B.at(0, c) = encode(type, 1), B.at(1, c) = encode(type, 64.0 * c);
      for (Form form : {Form::ss_kmajor_b, Form::ss_mnmajor_b, Form::rs_mnmajor_b}) {
        Shared s(kShared);
        store_operands(s, form, A, B);
        Accumulators acc(n);
        for (auto& regs : acc.regs)
          std::fill(regs.begin(), regs.end(), std::numeric_limits<float>::quiet_NaN());
        wgmma_step(form, type, A, B, 0, 0, s, acc);
        int wrong = 0;
        for (int t = 0; t < 128; ++t)
          for (int i = 0; i < n / 2; ++i) {
            const float want = float(wg_row(t, i) + 64 * wg_d_col(t, i));
            if (acc.regs[t][i] != want && ++wrong <= 5) {
              EMU_CHECK(acc.regs[t][i] == want, name(type), " m64n", n, "k16 ", form_name(form),
                        ": thread ", t, " d", i, " = ", acc.regs[t][i], ", want ", want, " (row ",
                        wg_row(t, i), ", col ", wg_d_col(t, i), ")");
            }
          }
        EMU_CHECK(wrong == 0, name(type), " m64n", n, "k16 ", form_name(form), ": ", wrong,
                  " registers wrong");
      }
    }
  }
}

EMU_TEST(isa_wgmma_one_hot) {
  // A = 2 at (m, k) only, B = 3 at (k, n) only: D + 6 at exactly the documented thread and
  // register of (m, n), D unchanged elsewhere (scale_d = 1), over every m, two k per m.
  const Type type = Type::bf16;
  for (int n_total : {64, 128}) {
    for (Form form : {Form::ss_kmajor_b, Form::ss_mnmajor_b, Form::rs_mnmajor_b}) {
      int wrong = 0;
      for (int m = 0; m < 64; ++m) {
        for (int k : {m % 16, (m + 5) % 16}) {
          const int n = (7 * m + 3 * k) % n_total;
          Matrix A(type, 64, 16), B(type, 16, n_total);
          A.at(m, k) = encode(type, 2);
          B.at(k, n) = encode(type, 3);
          Shared s(kShared);
          store_operands(s, form, A, B);
          Accumulators acc(n_total);
          for (int t = 0; t < 128; ++t)
            for (int i = 0; i < n_total / 2; ++i) acc.regs[t][i] = 0.5f * float(t + 128 * i);
          wgmma_step(form, type, A, B, 0, 1, s, acc);
          for (int t = 0; t < 128; ++t)
            for (int i = 0; i < n_total / 2; ++i) {
              const bool hit = wg_row(t, i) == m && wg_d_col(t, i) == n;
              const float want = 0.5f * float(t + 128 * i) + (hit ? 6.0f : 0.0f);
              if (acc.regs[t][i] != want && ++wrong <= 5) {
                EMU_CHECK(acc.regs[t][i] == want, form_name(form), " N ", n_total, " one-hot A(", m,
                          ",", k, ") B(", k, ",", n, "): thread ", t, " d", i, " = ",
                          acc.regs[t][i], ", want ", want);
              }
            }
        }
      }
      EMU_CHECK(wrong == 0, form_name(form), " N ", n_total, ": ", wrong, " wrong registers");
    }
  }
}

EMU_TEST(isa_wgmma_random_products) {
  // Random A (64 x K) and B (K x N) through the kernels' layouts, K / 16 steps as a kernel
  // issues them, against a double reference; scale_d of the first step 0 and 1.
  std::mt19937 rng(6);
  struct Case {
    Form form;
    int n, k;
  } cases[] = {
      {Form::ss_kmajor_b, 64, 64},   {Form::ss_kmajor_b, 128, 128}, {Form::ss_mnmajor_b, 64, 64},
      {Form::ss_mnmajor_b, 128, 64}, {Form::rs_mnmajor_b, 64, 128}, {Form::rs_mnmajor_b, 128, 64},
      {Form::rs_mnmajor_b, 256, 32}, {Form::ss_kmajor_b, 24, 32},   {Form::ss_mnmajor_b, 8, 16},
  };
  for (const Case& c : cases) {
    for (Type type : {Type::bf16, Type::f16}) {
      for (int first_scale_d : {0, 1}) {
        const Matrix A = random_matrix(type, 64, c.k, rng), B = random_matrix(type, c.k, c.n, rng);
        std::vector<double> d0(size_t(64) * c.n);
        std::normal_distribution<float> normal(0.0f, 8.0f);
        for (auto& v : d0)
          v = first_scale_d ? double(normal(rng)) : std::numeric_limits<double>::quiet_NaN();
        std::string where;
        const double worst = run_product(c.form, type, A, B, d0, first_scale_d, &where);
        EMU_CHECK(worst <= 1.0, name(type), " ", form_name(c.form), " m64n", c.n, " K ", c.k,
                  " scale_d ", first_scale_d, ": error ", worst, " x the bound at ", where);
      }
    }
  }
}

EMU_TEST(isa_wgmma_scale_d) {
  std::mt19937 rng(7);
  const Type type = Type::f16;
  const StepOperands ops(type, 64, Form::ss_mnmajor_b, rng);
  const std::vector<double> product = reference_product(ops.A, ops.B, {}, false, nullptr);
  for (int scale_d : {0, 1, -3}) {
    Accumulators acc(64);
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 64; ++c) acc.at(r, c) = float(r - c);
    isa::wgmma(type, 64, nullptr, a_step(0), b_mnmajor_step(16, 0), true, scale_d, ops.s.window(),
               acc.pointers);
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 64; ++c) {
        const double want = product[size_t(r) * 64 + c] + (scale_d ? double(r - c) : 0.0);
        EMU_CHECK(std::fabs(acc.at(r, c) - want) <= 1e-4 * (1 + std::fabs(want)), "scale_d ",
                  scale_d, " (", r, ",", c, "): ", acc.at(r, c), ", want ", want);
      }
  }
}

EMU_TEST(isa_wgmma_wrong_layouts_are_never_silently_right) {
  // Each descriptor below disagrees with how the data was stored: the product must come out
  // wrong or the call must throw. The first case is the control: the right descriptors.
  std::mt19937 rng(8);
  const Type type = Type::bf16;
  const Matrix A = random_matrix(type, 64, 16, rng), B = random_matrix(type, 16, 128, rng);
  auto kernel_layout = [&](Shared& s) {
    store_a(s, A);
    store_b_mnmajor(s, B);
  };
  const Outcome right = try_step(type, A, B, kernel_layout, a_step(0), b_mnmajor_step(16, 0), true);
  EMU_CHECK(!right.threw && right.worst <= 1.0, "control: ", right.message, " error ", right.worst);
  const Outcome right_rs =
      try_step(type, A, B, kernel_layout, 0, b_mnmajor_step(16, 0), true, true);
  EMU_CHECK(!right_rs.threw && right_rs.worst <= 1.0, "RS control: ", right_rs.message, " error ",
            right_rs.worst);

  struct Wrong {
    const char* what;
    uint64_t a, b;
    bool b_mn_major;
  } wrong[] = {
      {"A SBO 2048 for 1024", a_step(0, 0, 2048), b_mnmajor_step(16, 0), true},
      {"A SBO 512 for 1024", a_step(0, 0, 512), b_mnmajor_step(16, 0), true},
      {"A SBO 128 (unswizzled row pitch)", a_step(0, 0, 128), b_mnmajor_step(16, 0), true},
      {"A LBO 1024 (K-major has none)", a_step(0, 0, 1024, 1024), b_mnmajor_step(16, 0), true},
      {"B LBO 4096 for 2048", a_step(0), b_mnmajor_step(16, 0, 4096), true},
      {"B SBO 2048 for 1024", a_step(0), b_mnmajor_step(16, 0, 0, 2048), true},
      {"B LBO and SBO swapped", a_step(0), make_descriptor(kTileB, 1024, 2048), true},
      {"B read K-major", a_step(0), b_mnmajor_step(16, 0), false},
      {"B without swizzle", a_step(0), make_descriptor(kTileB, 2048, 1024, 0), true},
      {"B 64-byte swizzle", a_step(0), make_descriptor(kTileB, 2048, 1024, 2), true},
      {"A 32-byte swizzle", make_descriptor(kTileA, 16, 1024, 3), b_mnmajor_step(16, 0), true},
      {"A k step at 32 bytes", a_step(1), b_mnmajor_step(16, 0), true},
  };
  for (const Wrong& w : wrong) {
    const Outcome o = try_step(type, A, B, kernel_layout, w.a, w.b, w.b_mn_major);
    EMU_CHECK(o.threw || o.worst > 1e3, w.what, ": the product came out right");
  }
  // Tiles whose swizzle is relative to a start that is not 1024-byte aligned (the kernels'
  // swizzled() is relative to the tile): the hardware swizzles absolute addresses.
  for (uint32_t shift : {16u, 128u, 512u, 1024u + 256u}) {
    auto shifted = [&](Shared& s) {
      store_a(s, A, shift);
      store_b_mnmajor(s, B);
    };
    const Outcome o = try_step(type, A, B, shifted, a_step(0, shift), b_mnmajor_step(16, 0), true);
    EMU_CHECK(o.threw || o.worst > 1e3, "A tile at +", shift, ": the product came out right");
  }
  auto moved = [&](Shared& s) {
    store_a(s, A, 2048);
    store_b_mnmajor(s, B);
  };
  const Outcome aligned = try_step(type, A, B, moved, a_step(0, 2048), b_mnmajor_step(16, 0), true);
  EMU_CHECK(!aligned.threw && aligned.worst <= 1.0, "A tile at +2048 (aligned): ", aligned.message);
  // Data stored unswizzled (plain 128-byte rows) read through a 128-byte-swizzle descriptor.
  auto plain = [&](Shared& s) {
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) s.put(kTileA + m * 128 + k * 2, A.at(m, k));
    store_b_mnmajor(s, B);
  };
  const Outcome o = try_step(type, A, B, plain, a_step(0), b_mnmajor_step(16, 0), true);
  EMU_CHECK(o.threw || o.worst > 1e3, "unswizzled A read as swizzled: the product came out right");
}

EMU_TEST(isa_wgmma_rejects_bad_arguments) {
  std::mt19937 rng(9);
  const Type type = Type::bf16;
  const StepOperands ops(type, 64, Form::ss_kmajor_b, rng);
  Accumulators acc(64);
  for (auto& regs : acc.regs) std::fill(regs.begin(), regs.end(), 1.5f);
  for (int n : {0, 4, 12, 264, 512}) {
    Accumulators wide(512);
    EMU_CHECK_THROWS(isa::wgmma(type, n, nullptr, a_step(0), b_kmajor_step(64, 0), false, 0,
                                ops.s.window(), wide.pointers),
                     "N = ");
  }
  // Operands past the end of shared memory.
  EMU_CHECK_THROWS(isa::wgmma(type, 64, nullptr, make_descriptor(kShared - 1024, 16, 1024),
                              b_kmajor_step(64, 0), false, 0, ops.s.window(), acc.pointers),
                   "outside shared memory");
  EMU_CHECK_THROWS(
      isa::wgmma(type, 64, nullptr, a_step(0), make_descriptor(kShared + 4096, 16, 1024), false, 0,
                 ops.s.window(), acc.pointers),
      "outside shared memory");
  // A non-zero base offset; a start in the middle of a swizzle pattern.
  EMU_CHECK_THROWS(isa::wgmma(type, 64, nullptr, make_descriptor(kTileA, 16, 1024, 1, 2),
                              b_kmajor_step(64, 0), false, 0, ops.s.window(), acc.pointers),
                   "base offset");
  EMU_CHECK_THROWS(isa::wgmma(type, 64, nullptr, a_step(0), make_descriptor(kTileB + 384, 16, 1024),
                              false, 0, ops.s.window(), acc.pointers),
                   "boundary");
  // A missing accumulator pointer.
  float* pointers[128];
  std::copy(acc.pointers, acc.pointers + 128, pointers);
  pointers[77] = nullptr;
  EMU_CHECK_THROWS(isa::wgmma(type, 64, nullptr, a_step(0), b_kmajor_step(64, 0), false, 0,
                              ops.s.window(), pointers),
                   "thread 77");
  // None of the failed calls wrote an accumulator.
  bool untouched = true;
  for (auto& regs : acc.regs)
    for (float v : regs) untouched = untouched && v == 1.5f;
  EMU_CHECK(untouched, "a call that threw changed the accumulators");
}

}  // namespace
