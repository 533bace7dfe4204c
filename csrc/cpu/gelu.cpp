// bias_gelu and gelu_ffn on the CPU: ATen's matrix products, with the bias,
// GELU, dropout and their backward fused into one pass between them.
//
// The kernels: forward reads x and bias and writes y: 2 bytes moved per element in bf16, the
// least an elementwise op can do. Backward reads dy and x, writes dx, and folds
// the first stage of the bias-gradient reduction into the same pass.
#include "kernel.h"

#ifdef FUSEDLM_ISA
#include <memory>

#include "math.h"
#else

#include <vector>

#include "checks.h"
#include "common.h"
#include "ops/compiled_kernel.h"
#endif

// y = gelu(x + bias) [* keep / (1 - p)] over rows x cols, row-major; bias may be null.
FUSEDLM_CPU_KERNEL(bias_gelu_forward, void(DType, const void* x, const void* bias, void* y,
                                           int64_t rows, int64_t cols, Gelu, const uint8_t* keep,
                                           double p))

// dx = dy [* keep / (1 - p)] * gelu'(x + bias); dx may be dy itself (written in place).
// When act is not null it also receives the forward's output, gelu(x + bias) [* keep /
// (1 - p)], from the same evaluation of the normal CDF. When dbias_partial is not null it
// receives the column sums of dx over these rows (the first stage of the bias gradient), in
// the accumulation type: float64 for kF64, float32 otherwise.
FUSEDLM_CPU_KERNEL(bias_gelu_backward, void(DType, const void* dy, const void* x, const void* bias,
                                            void* dx, void* act, void* dbias_partial,
                                            int64_t rows, int64_t cols, Gelu, const uint8_t* keep,
                                            double p))

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;

// GELU and its derivative at z, in the accumulation type A, from one evaluation of the
// CDF (a caller that needs one of them leaves the other to dead-code elimination). The
// tanh form uses 0.5 * (1 + tanh(u)) = sigmoid(2u), which does not cancel for negative z.
template <typename A>
inline void gelu_and_grad(A z, Gelu kind, A& value, A& slope) {
  if (kind == Gelu::kErf) {
    gelu_erf(z, value, slope);
    return;
  }
  A u = A(kSqrt2OverPi) * (z + A(kTanhCubic) * z * z * z);
  A s = sigmoid(A(2) * u);
  A du = A(kSqrt2OverPi) * (A(1) + A(3 * kTanhCubic) * z * z);
  value = z * s;
  slope = s + z * A(2) * s * (A(1) - s) * du;
}

template <typename A>
inline A gelu(A z, Gelu kind) {
  A value, slope;
  gelu_and_grad(z, kind, value, slope);
  return value;
}

// The inner loops have no branches (GELU kind and dropout are template
// parameters, the bias is always an array) so that they vectorise. float16 rows go
// through float ones (widen_row, narrow_row), a row at a time.
template <typename T, Gelu kind, bool dropout>
void forward_rows(const T* x, const acc_t<T>* bias, T* y, int64_t rows, int64_t cols,
                  const uint8_t* keep, double p) {
  using A = acc_t<T>;
  if constexpr (std::is_same_v<T, f16>) {
    std::unique_ptr<float[]> scratch(new float[2 * cols]);
    float *xf = scratch.get(), *yf = xf + cols;
    for (int64_t r = 0; r < rows; ++r) {
      widen_row(x + r * cols, xf, cols);
      forward_rows<float, kind, dropout>(xf, bias, yf, 1, cols, keep + (dropout ? r * cols : 0), p);
      narrow_row(yf, y + r * cols, cols);
    }
    return;
  }
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

// dbias accumulates: the caller zeroes it. dx may alias dy; act is written when with_act.
template <typename T, Gelu kind, bool dropout, bool with_act>
void backward_rows(const T* dy, const T* x, const acc_t<T>* bias, T* dx, T* act,
                   acc_t<T>* dbias, int64_t rows, int64_t cols, const uint8_t* keep, double p) {
  using A = acc_t<T>;
  if constexpr (std::is_same_v<T, f16>) {
    std::unique_ptr<float[]> scratch(new float[4 * cols]);
    float *dyf = scratch.get(), *xf = dyf + cols, *dxf = xf + cols, *actf = dxf + cols;
    for (int64_t r = 0; r < rows; ++r) {
      widen_row(dy + r * cols, dyf, cols);
      widen_row(x + r * cols, xf, cols);
      backward_rows<float, kind, dropout, with_act>(dyf, xf, bias, dxf, actf, dbias, 1, cols,
                                                    keep + (dropout ? r * cols : 0), p);
      narrow_row(dxf, dx + r * cols, cols);
      if (with_act) narrow_row(actf, act + r * cols, cols);
    }
    return;
  }
  const A scale = A(1) / (A(1) - A(p));
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * cols;
    const T* xr = x + r * cols;
    T* dxr = dx + r * cols;
    T* actr = act + (with_act ? r * cols : 0);
    const uint8_t* kr = keep + (dropout ? r * cols : 0);
    // dx may be dy: each element is read before it is written, and never again, so the
    // loop has no dependence across elements. Without this GCC checks the pointers for
    // overlap at run time and, finding dx on dy, takes its scalar loop.
#pragma GCC ivdep
    for (int64_t c = 0; c < cols; ++c) {
      // keep is 0 or 1: a multiply, not a branch
      const A k = dropout ? A(kr[c]) * scale : A(1);
      A value, slope;
      gelu_and_grad<A>(load(xr[c]) + bias[c], kind, value, slope);
      A d = load(dyr[c]) * k * slope;
      store(dxr[c], d);
      dbias[c] += d;
      if (with_act) store(actr[c], value * k);
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

template <typename T, bool dropout, bool with_act>
auto backward_for(Gelu kind) {
  return kind == Gelu::kErf ? backward_rows<T, Gelu::kErf, dropout, with_act>
                            : backward_rows<T, Gelu::kTanh, dropout, with_act>;
}

template <typename T, bool dropout>
auto backward_for(Gelu kind, bool with_act) {
  return with_act ? backward_for<T, dropout, true>(kind) : backward_for<T, dropout, false>(kind);
}

}  // namespace

void bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t rows,
                       int64_t cols, Gelu kind, const uint8_t* keep, double p) {
  const FlushSubnormals flush;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto b = widen_bias(static_cast<const T*>(bias), cols);
    auto run = keep ? forward_for<T, true>(kind) : forward_for<T, false>(kind);
    run(static_cast<const T*>(x), b.get(), static_cast<T*>(y), rows, cols, keep, p);
  });
}

void bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias, void* dx,
                        void* act, void* dbias_partial, int64_t rows, int64_t cols, Gelu kind,
                        const uint8_t* keep, double p) {
  const FlushSubnormals flush;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto b = widen_bias(static_cast<const T*>(bias), cols);
    // Without a bias the column sums are still computed (into scratch): one loop shape.
    std::unique_ptr<acc_t<T>[]> scratch(dbias_partial ? nullptr : new acc_t<T>[cols]);
    auto* db = dbias_partial ? static_cast<acc_t<T>*>(dbias_partial) : scratch.get();
    for (int64_t c = 0; c < cols; ++c) db[c] = acc_t<T>(0);
    const bool with_act = act != nullptr;
    auto run = keep ? backward_for<T, true>(kind, with_act) : backward_for<T, false>(kind, with_act);
    run(static_cast<const T*>(dy), static_cast<const T*>(x), b.get(), static_cast<T*>(dx),
        static_cast<T*>(act), db, rows, cols, keep, p);
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA

#else  // the host role: entry points

namespace fusedlm {
namespace {

// Rows of a [rows, cols] tensor each task takes; keeps tasks near 64 KiB of input.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// The keep mask for rows [begin, end) of a [rows, cols] dropout stream.
const uint8_t* keep_rows(std::vector<uint8_t>& buffer, uint64_t seed, int64_t begin, int64_t end,
                         int64_t cols, double p) {
  if (p <= 0.0) return nullptr;
  buffer.resize((end - begin) * cols);
  cpu::dropout_mask(seed, static_cast<uint64_t>(begin * cols), (end - begin) * cols,
                             p, buffer.data());
  return buffer.data();
}

cpu::Gelu gelu_kind(bool tanh) { return tanh ? cpu::Gelu::kTanh : cpu::Gelu::kErf; }

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// out = dropout(gelu(pre + bias)) over the rows of a 2-d contiguous tensor, into out's
// contiguous memory (of any shape); bias is undefined or [cols].
void gelu_rows(const at::Tensor& pre, const at::Tensor& bias, at::Tensor& out, cpu::Gelu kind,
               double p, uint64_t seed) {
  const int64_t rows = pre.size(0), cols = pre.size(1);
  const auto dtype = kernel_dtype(pre);
  const size_t elem = pre.element_size();
  const char* src = static_cast<const char*>(pre.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const void* b = data_or_null(bias);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> keep;
    cpu::bias_gelu_forward(dtype, src + begin * cols * elem, b,
                                    dst + begin * cols * elem, end - begin, cols, kind,
                                    keep_rows(keep, seed, begin, end, cols, p),
                                    p);
  });
}

// d(pre) from d(out) for gelu_rows, into dpre's contiguous memory (which may be grad's);
// when act is given, gelu_rows' output too, into its contiguous memory. Returns the bias
// gradient (undefined without bias).
at::Tensor gelu_rows_backward(const at::Tensor& grad, const at::Tensor& pre, const at::Tensor& bias,
                              at::Tensor& dpre, cpu::Gelu kind, double p, uint64_t seed,
                              at::Tensor* act = nullptr) {
  const int64_t rows = pre.size(0), cols = pre.size(1);
  const bool has_bias = bias.defined();
  const int64_t blocks = (rows + kReduceBlockRows - 1) / kReduceBlockRows;
  auto partial = partial_sums(has_bias ? blocks : 0, cols, acc_dtype(pre.scalar_type()));
  const auto dtype = kernel_dtype(pre);
  const size_t elem = pre.element_size();
  const char* g = static_cast<const char*>(grad.data_ptr());
  const char* x = static_cast<const char*>(pre.data_ptr());
  char* dx = static_cast<char*>(dpre.data_ptr());
  char* out = act ? static_cast<char*>(act->data_ptr()) : nullptr;
  char* part = has_bias ? static_cast<char*>(partial.data_ptr()) : nullptr;
  const size_t part_row = cols * partial.element_size();
  const void* b = data_or_null(bias);
  // Tasks cover whole reduction blocks, so each partial sum has exactly one writer.
  const int64_t grain = std::max<int64_t>(1, grain_rows(cols) / kReduceBlockRows);
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> keep;
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kReduceBlockRows, end = std::min(rows, begin + kReduceBlockRows);
      const int64_t at = begin * cols * elem;
      cpu::bias_gelu_backward(dtype, g + at, x + at, b, dx + at, out ? out + at : nullptr,
                              part ? part + blk * part_row : nullptr, end - begin, cols, kind,
                              keep_rows(keep, seed, begin, end, cols, p), p);
    }
  });
  return has_bias ? sum_partials(partial, 0, blocks, bias.scalar_type()) : at::Tensor();
}

}  // namespace

// gelu(x + bias) over the last dimension; bias may be absent.
at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  const auto in = bias_gelu_inputs(x, bias, approximate, check_cpu);
  // Outputs are allocated in their final shapes: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options());
  gelu_rows(in.x, in.bias, out, gelu_kind(in.tanh), 0.0, 0);
  return out;
}
FUSEDLM_KERNEL(bias_gelu_forward);

// (dx, dbias); dbias is undefined when bias is absent.
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate) {
  const auto in = bias_gelu_grad_inputs(grad, x, bias, approximate, check_cpu);
  auto dx = at::empty(x.sizes(), in.x.options());
  auto db = gelu_rows_backward(in.grad, in.x, in.bias, dx, gelu_kind(in.tanh), 0.0, 0);
  return {dx, db};
}
FUSEDLM_KERNEL(bias_gelu_backward);

// Linear -> GELU -> dropout -> Linear. Returns (y, pre_activation), the one activation the
// backward needs: on the CPU x @ w1^T without its bias; on CUDA with b1 (each backend's
// backward reads its own). CUDA: bfloat16 and float16, d_in, d_ff and d_out multiples of 8.
std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed) {
  const auto in = gelu_ffn_inputs(x, w1, b1, w2, b2, approximate, check_cpu);
  auto pre = at::mm(in.x, in.w1.t());
  auto act = at::empty_like(pre);
  gelu_rows(pre, in.b1, act, gelu_kind(in.tanh), dropout_p, dropout_p > 0 ? seed_value(seed) : 0);
  return {ffn_output(x, act, in.w2, in.b2), pre};
}
FUSEDLM_KERNEL(gelu_ffn_forward);

// (dx, dw1, db1, dw2, db2); the bias gradients are undefined when a bias is absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed) {
  const auto in = gelu_ffn_grad_inputs(grad, x, pre_activation, w1, b1, w2, b2, approximate,
                                       check_cpu);
  const auto kind = gelu_kind(in.tanh);
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;
  const auto& g2 = in.grad;
  // The activation is recomputed from the saved pre-activation rather than stored, in the
  // pass that takes its gradient back through the GELU (one evaluation of the CDF), and
  // that gradient is written over the activation's, which nothing reads after.
  auto act = at::empty_like(in.pre_activation);
  auto dpre = at::mm(g2, in.w2);
  auto db1 = gelu_rows_backward(dpre, in.pre_activation, in.b1, dpre, kind, dropout_p, s, &act);
  const auto g = ffn_backward_products(in, x, g2, act, dpre);
  return {g.dx, g.dw1, db1, g.dw2, g.db2};
}
FUSEDLM_KERNEL(gelu_ffn_backward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
