// bias + GELU (+ dropout), forward and backward, one pass over memory each.
//
// Forward reads x and bias and writes y: 2 bytes moved per element in bf16, the
// least an elementwise op can do. Backward reads dy and x, writes dx, and folds
// the first stage of the bias-gradient reduction into the same pass.
#include <memory>

#include "math.h"

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;

// GELU and its derivative at z, in the accumulation type A. The tanh form uses
// 0.5 * (1 + tanh(u)) = sigmoid(2u), which does not cancel for negative z.
template <typename A>
inline A gelu(A z, Gelu kind) {
  if (kind == Gelu::kErf) return z * normal_cdf(z);
  A u = A(kSqrt2OverPi) * (z + A(kTanhCubic) * z * z * z);
  return z * sigmoid(A(2) * u);
}

template <typename A>
inline A gelu_grad(A z, Gelu kind) {
  if (kind == Gelu::kErf) return normal_cdf(z) + z * A(kInvSqrt2Pi) * exp_(A(-0.5) * z * z);
  A u = A(kSqrt2OverPi) * (z + A(kTanhCubic) * z * z * z);
  A s = sigmoid(A(2) * u);
  A du = A(kSqrt2OverPi) * (A(1) + A(3 * kTanhCubic) * z * z);
  return s + z * A(2) * s * (A(1) - s) * du;
}

// The inner loops have no branches (GELU kind and dropout are template
// parameters, the bias is always an array) so that they vectorise.
template <typename T, Gelu kind, bool dropout>
void forward_rows(const T* x, const acc_t<T>* bias, T* y, int64_t rows, int64_t cols,
                  const uint8_t* keep, double p) {
  using A = acc_t<T>;
  const A scale = A(1) / (A(1) - A(p));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    const uint8_t* kr = keep + (dropout ? r * cols : 0);
    for (int64_t c = 0; c < cols; ++c) {
      A g = gelu<A>(load(xr[c]) + bias[c], kind);
      if (dropout) g *= A(kr[c]) * scale;  // keep is 0 or 1: a multiply, not a branch
      store(yr[c], g);
    }
  }
}

template <typename T, Gelu kind, bool dropout>
void backward_rows(const T* dy, const T* x, const acc_t<T>* bias, T* dx, acc_t<T>* dbias,
                   int64_t rows, int64_t cols, const uint8_t* keep, double p) {
  using A = acc_t<T>;
  const A scale = A(1) / (A(1) - A(p));
  for (int64_t c = 0; c < cols; ++c) dbias[c] = A(0);
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * cols;
    const T* xr = x + r * cols;
    T* dxr = dx + r * cols;
    const uint8_t* kr = keep + (dropout ? r * cols : 0);
    for (int64_t c = 0; c < cols; ++c) {
      A g = load(dyr[c]);
      if (dropout) g *= A(kr[c]) * scale;  // keep is 0 or 1: a multiply, not a branch
      A d = g * gelu_grad<A>(load(xr[c]) + bias[c], kind);
      store(dxr[c], d);
      dbias[c] += d;
    }
  }
}

// The bias widened to the accumulation type, or zeros when there is none.
template <typename T>
std::unique_ptr<acc_t<T>[]> widen_bias(const T* bias, int64_t cols) {
  std::unique_ptr<acc_t<T>[]> out(new acc_t<T>[cols]);
  for (int64_t c = 0; c < cols; ++c) out[c] = bias ? load(bias[c]) : acc_t<T>(0);
  return out;
}

template <typename T, bool dropout>
auto forward_for(Gelu kind) {
  return kind == Gelu::kErf ? forward_rows<T, Gelu::kErf, dropout> : forward_rows<T, Gelu::kTanh, dropout>;
}

template <typename T, bool dropout>
auto backward_for(Gelu kind) {
  return kind == Gelu::kErf ? backward_rows<T, Gelu::kErf, dropout> : backward_rows<T, Gelu::kTanh, dropout>;
}

}  // namespace

void bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t rows,
                       int64_t cols, Gelu kind, const uint8_t* keep, double p) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto b = widen_bias(static_cast<const T*>(bias), cols);
    auto run = keep ? forward_for<T, true>(kind) : forward_for<T, false>(kind);
    run(static_cast<const T*>(x), b.get(), static_cast<T*>(y), rows, cols, keep, p);
  });
}

void bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias, void* dx,
                        void* dbias_partial, int64_t rows, int64_t cols, Gelu kind,
                        const uint8_t* keep, double p) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto b = widen_bias(static_cast<const T*>(bias), cols);
    // Without a bias the column sums are still computed (into scratch): one loop shape.
    std::unique_ptr<acc_t<T>[]> scratch(dbias_partial ? nullptr : new acc_t<T>[cols]);
    auto* db = dbias_partial ? static_cast<acc_t<T>*>(dbias_partial) : scratch.get();
    auto run = keep ? backward_for<T, true>(kind) : backward_for<T, false>(kind);
    run(static_cast<const T*>(dy), static_cast<const T*>(x), b.get(), static_cast<T*>(dx), db,
        rows, cols, keep, p);
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA
