// Element conversion and branch-free math for the per-instruction-set kernels.
//
// Everything here is written so that GCC and Clang vectorise the loops that call
// it (no branches, no library calls on the float path): the same source becomes
// SSE2, AVX2 or AVX-512 code depending on the flags of the compilation. It lives
// in the per-ISA namespace, so the three copies never collide at link time.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel.h"

#ifdef __F16C__
#include <immintrin.h>
#endif
#ifdef __SSE__
#include <xmmintrin.h>
#endif

#ifndef FUSEDLM_ISA
#error "csrc/cpu sources are compiled once per instruction set with -DFUSEDLM_ISA=<name>"
#endif

namespace fusedlm::cpu::FUSEDLM_ISA {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// All ones where cond holds, else zero: select(mask, a, b) picks without a branch.
// Written this way, both sides are computed unconditionally; as a ?: GCC may sink
// a side's float arithmetic into a branch, which it then will not if-convert
// (float operations may trap, under the default -ftrapping-math), and a loop
// with a branch does not vectorise.
inline uint32_t select_mask(bool cond) { return 0u - uint32_t(cond); }
inline uint32_t select(uint32_t mask, uint32_t if_set, uint32_t if_clear) {
  return (if_set & mask) | (if_clear & ~mask);
}

// While one lives, this thread's arithmetic flushes subnormal results to zero (MXCSR's
// flush-to-zero bit); inputs are read as they are. The kernels of transcendental functions
// take one. On x86 every subnormal result costs a microcode assist of a hundred cycles or
// more for its whole vector, and such results come from ordinary inputs: GELU's tail near
// |z| = 13, a sigmoid near -87, an LSTM's saturated gates, a softmax's far logits. A
// kernel fed a few of them ran several times slower. Results that small are below what
// these kernels are accurate to, and GPUs flush them too. A no-op without SSE.
struct FlushSubnormals {
#ifdef __SSE__
  unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | _MM_FLUSH_ZERO_ON); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
#else
  FlushSubnormals() {}  // user-provided, so that a const one may be declared
#endif
};

// Loads widen to float (double stays double); stores round to nearest even.
inline float load(float v) { return v; }
inline double load(double v) { return v; }
inline float load(bf16 v) { return bits_to_float(uint32_t(v.bits) << 16); }
inline float load(f16 v) {
  // IEEE half -> float without F16C, branch-free (handles subnormals, inf, nan).
  uint32_t h = v.bits, sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
  // Normal numbers: rebias the exponent. Inf/NaN: force the float exponent to 255.
  uint32_t normal = (em << 13) + ((127 - 15) << 23);
  uint32_t special = (em << 13) | 0x7f800000u;
  // Subnormals: the mantissa is an integer multiple of 2^-24.
  uint32_t sub = float_to_bits(float(int32_t(em)) * 5.9604644775390625e-8f);
  uint32_t out = select(select_mask(em >= 0x7c00u), special, normal);
  out = select(select_mask(em < 0x0400u), sub, out);
  return bits_to_float(out | sign);
}

inline void store(float& dst, float v) { dst = v; }
inline void store(double& dst, double v) { dst = v; }
inline void store(bf16& dst, float v) {
  uint32_t u = float_to_bits(v);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;  // keep NaN a (quiet) NaN
  dst.bits = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline void store(f16& dst, float v) {
  // float -> IEEE half, round to nearest even, branch-free.
  uint32_t u = float_to_bits(v), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  // Normal range: add the rounding bias then rebias the exponent.
  uint32_t normal = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - ((127 - 15) << 10);
  // Subnormal range: let the FPU round by adding 0.5 (which aligns the mantissa).
  uint32_t sub = float_to_bits(bits_to_float(a) + 0.5f) - 0x3f000000u;
  uint32_t out = select(select_mask(a < 0x38800000u), sub, normal);
  out = select(select_mask(a >= 0x47800000u), 0x7c00u, out);                         // overflow -> inf
  out = select(select_mask(a > 0x7f800000u), 0x7e00u | ((a >> 13) & 0x3ffu), out);  // nan
  dst.bits = uint16_t(out | sign);
}

// Rows of float16 widened to float, and float rows narrowed to float16 (round to nearest
// even, as store): F16C's conversions, 8 elements an instruction, where the instruction set
// has them. GCC vectorises no F16C conversion of single elements, and load/store's bit
// arithmetic costs more than a cheap kernel's own work, so such kernels convert float16
// rows in bulk with these and compute on float rows.
inline void widen_row(const f16* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = load(src[i]);
}
inline void narrow_row(const float* src, f16* dst, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) store(dst[i], src[i]);
}

// exp(x) for x in [-87.3, 88.7] (where e^x is a normal float), to ~1 ulp: Cephes' expf
// polynomial, with no clamping of its own.
inline float exp_in_range_f(float x) {
  // Round to nearest by the 1.5 * 2^23 trick: no roundps needed, so SSE2 vectorises it too.
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_float(uint32_t(int32_t(n) + 127) << 23);
}

// exp(x) to ~1 ulp on [-87.3, 88.7]; 0 below, +inf above.
inline float exp_f(float x) {
  float y = exp_in_range_f(x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x));
  y = x < -87.33654f ? 0.0f : y;
  return x > 88.72283f ? INFINITY : y;
}

// The standard normal density phi(a) = exp(-a^2 / 2) / sqrt(2 pi), for 0 <= a <= 13.25, to
// 1e-7 relative: 2^y with y = -a^2 log2(e) / 2, as a degree-6 fit of 2^f on f in
// [-0.5, 0.5] (its coefficients divided by sqrt(2 pi), which costs no instruction) times
// 2^n, n = round(y). Adding 1.5 * 2^23 + 127 rounds y + 127 to an integer and leaves it in
// the sum's low mantissa bits; shifted left by 23 they are 2^n's exponent field (the
// constant's own bits shift out), so no conversion to an integer is needed. a <= 13.25
// keeps y > -127: where n = -127 the field is 0 and the result exactly 0. Just above, from
// a = 13.15 (n = -126, or -125 with a fit below 1/2), the result is subnormal, which the
// calling kernel's FlushSubnormals turns to 0.
inline float normal_pdf_f(float a) {
  const float y = a * a * -0.72134752044448170f;
  const float m = y + 12583039.0f;           // 1.5 * 2^23 + 127
  const float f = y - (m - 12583039.0f);     // y - n, in [-0.5, 0.5]
  float q = 6.1220926e-5f;
  q = q * f + 5.34579915e-4f;
  q = q * f + 3.83722200e-3f;
  q = q * f + 2.21426077e-2f;
  q = q * f + 9.58364904e-2f;
  q = q * f + 0.276525706f;
  q = q * f + 0.398942280f;
  return q * bits_to_float(float_to_bits(m) << 23);
}

// GELU with the exact normal CDF, and its derivative: value = z Phi(z) and
// slope = Phi(z) + z phi(z), from one lower tail Phi(-a), a = |z|, and one density phi(a).
//
// The tail is erfcx times the density, Phi(-a) = t P(t) phi(a) with t = 1 / (1 + 0.42 u),
// u = a / sqrt 2: P (degree 7; 0.42 is where a degree-7 fit does best) fits
// sqrt(pi / 2) erfcx(u) to a relative 1.7e-7 over float's range (4.6e-7 as float evaluates
// it), so the tail is accurate relative to itself, not only to float's epsilon as
// 1 - Phi would be, and GELU's negative side keeps its digits (1.1e-6 relative down to
// z = -5, and 5.2e-6 at worst, near z = -13, from the rounding of a^2). a is capped at
// 13.25: beyond it the density flushes to 0 (past float's normal range), so Phi is 0 or 1
// and the cap changes nothing, but +-inf give value inf or 0 and slope 1 or 0 rather than
// NaN from inf * 0; a NaN stays NaN (the cap's compare is false for it). With
// d = Phi(-a) - a phi(a) = (t P - a) phi, value = max(z, 0) - a Phi(-a) and slope = d for
// z < 0, 1 - d otherwise. a Phi(-a) is formed as (a t P) phi, a t P being near 1: Phi(-a)
// alone leaves float's normal range from a = 12.95, where the value is still normal, and
// the kernels flush subnormal results (FlushSubnormals). The loops are bound by their
// vector instructions (about 36 per 16 values, 38 per 16 slopes, loads and stores
// included), so each counts: no select but the slope's, no clamp but the cap, no
// float-to-integer conversion, no constant factor of its own.
inline void gelu_erf(float z, float& value, float& slope) {
  float a = std::fabs(z);
  a = a > 13.25f ? 13.25f : a;  // NaN kept: the compare is false
  const float t = 1.0f / (1.0f + 0.29698484809834991f * a);
  float p = 0.0882179365f;
  p = p * t - 0.402210981f;
  p = p * t + 0.553751349f;
  p = p * t - 0.164947242f;
  p = p * t + 0.337549835f;
  p = p * t + 0.24382709f;
  p = p * t + 0.300313294f;
  p = p * t + 0.296812683f;
  const float phi = normal_pdf_f(a);
  const float tp = t * p;
  value = (z > 0.0f ? z : 0.0f) - (a * tp) * phi;
  const float d = (tp - a) * phi;
  slope = z < 0.0f ? d : 1.0f - d;
}
inline void gelu_erf(double z, double& value, double& slope) {
  const double cdf = 0.5 * std::erfc(-z * 0.70710678118654752440);
  value = z * cdf;
  slope = cdf + z * std::exp(-0.5 * z * z) * 0.39894228040143267794;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_f(-x)); }
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x), both from e = exp(-|x|) <= 1: 1 / (1 + e)
// and e / (1 + e). The gradient's s (1 - s) then has no cancellation, where 1 - s from a
// rounded s near 1 loses the bits it needs.
inline void sigmoid_both(float x, float& s, float& rest) {
  const float e = exp_f(-std::fabs(x)), big = 1.0f / (1.0f + e), small = e * big;
  s = x >= 0.0f ? big : small;
  rest = x >= 0.0f ? small : big;
}
inline void sigmoid_both(double x, double& s, double& rest) {
  const double e = std::exp(-std::fabs(x)), big = 1.0 / (1.0 + e), small = e * big;
  s = x >= 0.0 ? big : small;
  rest = x >= 0.0 ? small : big;
}

inline float exp_(float x) { return exp_f(x); }
inline double exp_(double x) { return std::exp(x); }

// tanh to a few ulp. Below |x| = 0.625 an odd polynomial (Cephes' tanhf): there
// (1 - e) / (1 + e) cancels, and its relative error grows as 1 / |x| (1e-3 at 1e-4).
// Above, from e = exp(-2|x|) <= 1, which cannot overflow. Both are computed and one
// selected, so the loops stay vector code; the sign is put back without a branch.
inline float tanh_(float x) {
  const float a = std::fabs(x), z = x * x;
  const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                        1.33314422036e-1f) * z - 3.33332819422e-1f) * z * a + a;
  const float e = exp_f(-2.0f * a);
  return std::copysign(a < 0.625f ? small : (1.0f - e) / (1.0f + e), x);
}
inline double tanh_(double x) { return std::tanh(x); }

// 1 - tanh(x)^2 without cancellation: from the polynomial below |x| = 0.625, where
// tanh^2 < 0.31, and as 4e / (1 + e)^2 with e = exp(-2|x|) above.
inline float tanh_grad(float x) {
  const float a = std::fabs(x), t = tanh_(x), e = exp_f(-2.0f * a), d = 1.0f + e;
  return a < 0.625f ? 1.0f - t * t : 4.0f * e / (d * d);
}
inline double tanh_grad(double x) {
  const double t = std::tanh(x);
  return 1.0 - t * t;
}

// Calls f with a typed null pointer for the element type, f(static_cast<T*>(nullptr)).
template <typename F>
inline void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: f(static_cast<float*>(nullptr)); break;
    case DType::kF64: f(static_cast<double*>(nullptr)); break;
    case DType::kBF16: f(static_cast<bf16*>(nullptr)); break;
    case DType::kF16: f(static_cast<f16*>(nullptr)); break;
  }
}

// The arithmetic type of an element type: double for double, float otherwise.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <typename T> using acc_t = typename Acc<T>::type;

}  // namespace fusedlm::cpu::FUSEDLM_ISA
