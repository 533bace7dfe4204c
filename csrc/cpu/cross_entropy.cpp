// cross_entropy, distillation_loss and masked_lm_loss on the CPU.
//
// cross_entropy: one pass of the fused kernel gives the per-row losses and, in a new
// buffer, d(loss)/d(logits), already divided by the number of labelled rows for
// "mean". The backward only scales that buffer by grad_output.
//
// masked_lm_loss: the loop of csrc/masked_lm.cpp, with the fused kernel for each chunk
// (which also sums the gradient's columns, the bias gradient).
//
// The kernel: one sweep over each row of logits gives the row's loss and
// d(loss)/d(logits). Per row of C classes: the classes are streamed in blocks of kBlock. A first
// read of a block gives its max, and the running max M rises to it (the running sum of
// exponentials is rescaled once, by exp(M_old - M_new)); a second read, now from L1,
// writes e_j = exp(x_j - M) to a scratch row while summing it and the logits (label
// smoothing needs the latter). That is the online log-sum-exp, at one exponential per
// element. The gradient then comes from the scratch row, softmax_j = e_j * exp(M_b - lse)
// with M_b the M of e_j's block: a multiply per element, not a second exponential.
//
// Memory traffic: the logits are read once from memory and the gradient written once;
// the gradient may overwrite the logits, since the scratch row (C accumulator values,
// 120 KiB at C = 30522, L2-resident) holds everything the second pass needs. What
// limits it: exp_f, about 30 instructions per vector of 16 floats with AVX-512 (GCC 12
// leaves math.h's exp_f scalar in the AVX2 and baseline builds, ~6x slower there),
// then the bandwidth of that one read and one write.
//
// Sums over the classes run in kLanes independent partial sums combined in a fixed
// order: their loops are elementwise across lanes, so they vectorise without
// -ffast-math, and no result depends on the thread count.
#include "kernel.h"

#ifdef FUSEDLM_ISA
#include <algorithm>
#include <vector>

#include "math.h"
#else
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/compiled_kernel.h"
#include "checks.h"
#include "common.h"
#include "masked_lm.h"
#endif

// Softmax cross-entropy over the rows of row-major [rows, classes] logits, with the
// gradient in the same pass. Row r with labels[r] != ignore_index gets
//   loss[r] = (1 - eps) * (lse - x[y]) + eps * (lse - mean_j x[j])    (eps: label_smoothing)
//   grad[r, j] = s_r * (softmax_j - eps / classes - (1 - eps) * [j == y]),
//   s_r = grad_scale * row_scale[r] (row_scale may be null: 1);
// a row whose label is ignore_index gets loss 0 and a zero gradient row. Labels must be
// in [0, classes) otherwise. grad may be null (loss only) or equal logits (in place).
// When col_sum is not null it receives the column sums of grad over these rows.
// loss, col_sum and row_scale are in the accumulation type (float64 for kF64, else float32).
FUSEDLM_CPU_KERNEL(cross_entropy_forward, void(DType, const void* logits, const int64_t* labels,
                                               void* loss, void* grad, void* col_sum, int64_t rows,
                                               int64_t classes, int64_t ignore_index,
                                               double label_smoothing, double grad_scale,
                                               const void* row_scale))

// DistilBERT's soft-target loss of rows x classes (row-major student and teacher logits, one
// dtype), p = softmax(teacher / T) and q = softmax(student / T) per row:
//   loss[r] = T^2 * sum_j p_j (log p_j - log q_j)      (accumulation type)
//   grad[r, j] = grad_scale * T * (q_j - p_j)           (grad may be null: loss only)
FUSEDLM_CPU_KERNEL(distillation_loss_forward, void(DType, const void* student, const void* teacher,
                                                   void* loss, void* grad, int64_t rows,
                                                   int64_t classes, double temperature,
                                                   double grad_scale))

// dst[r, c] = src[r, c] * scale[r * scale_stride], scale in the accumulation type
// (scale_stride 0: one scale for every row). The backward of cross_entropy.
FUSEDLM_CPU_KERNEL(cross_entropy_scale_grad, void(DType, const void* src, void* dst, int64_t rows,
                                                  int64_t cols, const void* scale,
                                                  int64_t scale_stride))

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

constexpr int64_t kLanes = 16;   // one AVX-512 float vector; two AVX2 ones
constexpr int64_t kBlock = 2048;  // classes per block: 8 KiB of float32 logits, L1-resident

template <typename A>
inline A max_(A a, A b) { return b > a ? b : a; }

template <typename A>
inline A sum_lanes(const A* v) {
  A s = v[0];
  for (int64_t k = 1; k < kLanes; ++k) s += v[k];
  return s;
}

// A float's bits as an int32 that orders like the float (NaNs beyond +-inf). GCC
// vectorises an integer max reduction on any instruction set, a float one only
// with -ffast-math. The max is exact, so the order of that reduction does not matter.
inline int32_t order_key(float v) {
  const int32_t i = int32_t(float_to_bits(v));
  return i ^ ((i >> 31) & 0x7fffffff);
}
inline float from_order_key(int32_t k) { return bits_to_float(uint32_t(k ^ ((k >> 31) & 0x7fffffff))); }

// max over x[0, n). A NaN of either sign makes the row's loss NaN through block_exp.
template <typename T>
inline float block_max(const T* x, int64_t n) {
  int32_t m = order_key(-INFINITY);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t k = order_key(load(x[j]));
    m = k > m ? k : m;
  }
  return from_order_key(m);
}
inline double block_max(const double* x, int64_t n) {
  double m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = max_(m, x[j]);
  return m;
}

// sum of exp(x_j - m) over x[0, n), also stored to e when kStore; adds each x_j to the
// per-lane sums sum_x.
template <bool kStore, typename T, typename A>
inline A block_exp(const T* x, int64_t n, A m, A* e, A* sum_x) {
  A s[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) {
      const A v = load(x[j + k]), p = exp_(v - m);
      if (kStore) e[j + k] = p;
      s[k] += p;
      sum_x[k] += v;
    }
  for (; j < n; ++j) {
    const A v = load(x[j]), p = exp_(v - m);
    if (kStore) e[j] = p;
    s[0] += p;
    sum_x[0] += v;
  }
  return sum_lanes(s);
}

// g[j] = e[j] * f - off, and col_sum[j] += g[j] when kColSum.
template <bool kColSum, typename T, typename A>
inline void block_grad(const A* e, int64_t n, A f, A off, T* g, A* col_sum) {
  for (int64_t j = 0; j < n; ++j) {
    A v = e[j] * f - off;
    store(g[j], v);
    if (kColSum) col_sum[j] += v;
  }
}

template <typename T, bool kGrad, bool kColSum>
void rows_kernel(const T* logits, const int64_t* labels, acc_t<T>* loss, T* grad,
                 acc_t<T>* col_sum, int64_t rows, int64_t classes, int64_t ignore_index,
                 double label_smoothing, double grad_scale, const acc_t<T>* row_scale) {
  using A = acc_t<T>;
  const int64_t blocks = (classes + kBlock - 1) / kBlock;
  const A eps = A(label_smoothing);
  std::vector<A> scratch(kGrad ? classes : 0);
  std::vector<A> block_ref(kGrad ? blocks : 0);  // what each block's e_j are relative to
  if (kColSum)
    for (int64_t j = 0; j < classes; ++j) col_sum[j] = A(0);

  for (int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * classes;
    T* g = kGrad ? grad + r * classes : nullptr;
    const int64_t y = labels[r];
    if (y == ignore_index) {
      loss[r] = A(0);
      if (kGrad)
        for (int64_t j = 0; j < classes; ++j) store(g[j], A(0));
      continue;
    }
    const A x_y = load(x[y]);  // read before g, which may be x, is written

    A sum_x[kLanes] = {};
    A m = -INFINITY, s = A(0);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = b * kBlock, n = std::min(kBlock, classes - at);
      const A next = max_(m, A(block_max(x + at, n)));
      // The block's exponentials are relative to the running max, or to 0 while every
      // logit so far is -inf (exp(-inf - -inf) would be NaN where the terms are 0).
      const A ref = next == -INFINITY ? A(0) : next;
      s = (next == m ? s : s * exp_(m - next)) +
          block_exp<kGrad>(x + at, n, ref, kGrad ? scratch.data() + at : nullptr, sum_x);
      m = next;
      if (kGrad) block_ref[b] = ref;
    }
    const A log_s = std::log(s), lse = m + log_s;
    // torch's label smoothing: (1 - eps) * nll + eps * mean_j(-log softmax_j). Each term is
    // a sum of non-negative parts: lse - x_y would keep only lse's rounding of a small loss.
    const A nll = (m - x_y) + log_s;
    loss[r] = eps == A(0) ? nll
                          : (A(1) - eps) * nll + eps * ((m - sum_lanes(sum_x) / A(classes)) + log_s);
    if (!kGrad) continue;

    // d loss / d x_j = scale * (softmax_j - eps / C - (1 - eps) [j == y]).
    const A scale = A(grad_scale) * (row_scale ? row_scale[r] : A(1));
    const A off = scale * eps / A(classes);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = b * kBlock, n = std::min(kBlock, classes - at);
      const A f = exp_(block_ref[b] - lse) * scale;
      block_grad<kColSum>(scratch.data() + at, n, f, off, g + at, kColSum ? col_sum + at : nullptr);
    }
    // The label's own term, recomputed so its value is rounded once.
    const A on = scale * (A(1) - eps);
    store(g[y], scratch[y] * (exp_(block_ref[y / kBlock] - lse) * scale) - off - on);
    if (kColSum) col_sum[y] -= on;
  }
}

// sum of e_j = exp(x_j * inv_t - m) over x[0, n), in kLanes partial sums; e receives e_j.
template <typename T, typename A>
inline A exp_scaled(const T* x, int64_t n, A inv_t, A m, A* e) {
  A s[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) s[k] += e[j + k] = exp_(load(x[j + k]) * inv_t - m);
  for (; j < n; ++j) s[0] += e[j] = exp_(load(x[j]) * inv_t - m);
  return sum_lanes(s);
}

// The term of class j of KL(p || q) written as q_j * h(w_j), w = log p_j - log q_j, with
// h(w) = 1 - e^w (1 - w) = p log(p / q) - p + q over q (the added -p + q sum to 0 over
// the classes). Every term is >= 0, so the sum does not cancel as sum p log(p / q) does
// when the two distributions are close, and a constant error in w (the rounding of the
// log-sum-exps) moves it only in proportion. Near w = 0, where 1 - e^w (1 - w) cancels,
// h is its series: sum over k >= 2 of (k - 1) / k! * w^k.
// Both forms are computed and one selected, without branches, so that the loop vectorises.
template <typename A>
inline A divergence_term(A p, A q, A w) {
  constexpr double kFactorial[] = {2, 6, 24, 120, 720, 5040, 40320, 362880, 3628800, 39916800,
                                   479001600};
  A poly = A(11 / kFactorial[10]);  // k = 12 down to 2, Horner
  for (int k = 11; k >= 2; --k) poly = poly * w + A((k - 1) / kFactorial[k - 2]);
  const A near = q * w * w * poly, far = q - p * (A(1) - w);
  const A term = (w < A(0.25)) & (w > A(-0.25)) ? near : far;
  return p > A(0) ? term : q;  // h(-inf) = 1: a class the teacher rules out adds q
}

// DistilBERT's soft-target loss of each row, with p = softmax(teacher / T) and
// q = softmax(student / T): loss = T^2 * sum_j p_j (log p_j - log q_j), and
// grad_j = grad_scale * T * (q_j - p_j). Three sweeps over the row pair (L2-resident at
// a BERT vocabulary): the maxima; the exponentials, summed and kept in two scratch rows;
// then the divergence (as divergence_term's sum) and the gradient, with p and q from the
// scratch rows (two exponentials per class in all) and log p, log q from the shifted
// logits, the shift first, as log_softmax does, so that a class near the max keeps its
// digits.
template <typename T>
void distill_rows(const T* student, const T* teacher, acc_t<T>* loss, T* grad, int64_t rows,
                  int64_t classes, double temperature, double grad_scale) {
  using A = acc_t<T>;
  const A inv_t = A(1) / A(temperature), t = A(temperature);
  std::vector<A> eq(classes), ep(classes);
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = student + r * classes;
    const T* y = teacher + r * classes;
    const A mx = A(block_max(x, classes)) * inv_t, my = A(block_max(y, classes)) * inv_t;
    const A zq = exp_scaled(x, classes, inv_t, mx, eq.data());
    const A zp = exp_scaled(y, classes, inv_t, my, ep.data());
    const A log_zq = std::log(zq), log_zp = std::log(zp), rq = A(1) / zq, rp = A(1) / zp;
    A kl[kLanes] = {};
    const A scale = A(grad_scale) * t;
    auto term = [&](int64_t j, int64_t lane) {
      const A log_q = (load(x[j]) * inv_t - mx) - log_zq;
      const A log_p = (load(y[j]) * inv_t - my) - log_zp;
      const A p = ep[j] * rp, q = eq[j] * rq;
      kl[lane] += divergence_term(p, q, log_p - log_q);
      if (grad) store(grad[r * classes + j], scale * (q - p));
    };
    int64_t j = 0;
    for (; j + kLanes <= classes; j += kLanes)
      for (int64_t k = 0; k < kLanes; ++k) term(j + k, k);
    for (; j < classes; ++j) term(j, 0);
    loss[r] = t * t * sum_lanes(kl);
  }
}

template <typename T>
void scale_rows(const T* src, T* dst, int64_t rows, int64_t cols, const acc_t<T>* scale,
                int64_t scale_stride) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const A s = scale[r * scale_stride];
    const T* in = src + r * cols;
    T* out = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) store(out[c], load(in[c]) * s);
  }
}

}  // namespace

void cross_entropy_forward(DType dtype, const void* logits, const int64_t* labels, void* loss,
                           void* grad, void* col_sum, int64_t rows, int64_t classes,
                           int64_t ignore_index, double label_smoothing, double grad_scale,
                           const void* row_scale) {
  const FlushSubnormals flush;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    auto run = !grad ? rows_kernel<T, false, false>
                     : (col_sum ? rows_kernel<T, true, true> : rows_kernel<T, true, false>);
    run(static_cast<const T*>(logits), labels, static_cast<A*>(loss), static_cast<T*>(grad),
        static_cast<A*>(col_sum), rows, classes, ignore_index, label_smoothing, grad_scale,
        static_cast<const A*>(row_scale));
  });
}

void distillation_loss_forward(DType dtype, const void* student, const void* teacher, void* loss,
                               void* grad, int64_t rows, int64_t classes, double temperature,
                               double grad_scale) {
  const FlushSubnormals flush;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    distill_rows(static_cast<const T*>(student), static_cast<const T*>(teacher),
                 static_cast<acc_t<T>*>(loss), static_cast<T*>(grad), rows, classes, temperature,
                 grad_scale);
  });
}

void cross_entropy_scale_grad(DType dtype, const void* src, void* dst, int64_t rows, int64_t cols,
                              const void* scale, int64_t scale_stride) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_rows(static_cast<const T*>(src), static_cast<T*>(dst), rows, cols,
               static_cast<const acc_t<T>*>(scale), scale_stride);
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA

#else  // the host role: entry points

namespace fusedlm {
namespace {

// Rows of a [rows, cols] tensor each task takes; keeps tasks near 64 KiB of input.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// How many labels are not ignore_index. Every other label must be a class index: the
// kernel reads logits[label] unchecked.
int64_t count_labelled(const at::Tensor& labels1, int64_t classes, int64_t ignore_index) {
  const int64_t* y = labels1.data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < labels1.numel(); ++i) {
    if (y[i] == ignore_index) continue;
    // (the message is fusedlm.ops.cross_entropy's: the cpu backend checks labels here alone)
    TORCH_CHECK_VALUE(0 <= y[i] && y[i] < classes, "labels must be class indices in [0, ",
                      classes, ") or ignore_index (", ignore_index, "), got ", y[i]);
    ++count;
  }
  return count;
}

// The fused kernel over logits2 [rows, classes] (contiguous). loss (memory for rows values of
// the accumulation dtype) receives the losses; grad is undefined (loss only) or the contiguous memory of
// rows * classes elements, possibly logits2 itself; col_partial, when defined, is [ceil(rows / kReduceBlockRows), classes] and
// receives the column sums of grad per block of rows; row_scale is undefined or [rows].
// col_partial and row_scale are in the accumulation dtype.
void run_kernel(const at::Tensor& logits2, const at::Tensor& labels1, void* loss,
                const at::Tensor& grad, const at::Tensor& col_partial, int64_t ignore_index,
                double label_smoothing, double grad_scale, const at::Tensor& row_scale) {
  const int64_t rows = logits2.size(0), classes = logits2.size(1);
  const auto dtype = kernel_dtype(logits2);
  const size_t elem = logits2.element_size();
  const size_t acc = c10::elementSize(acc_dtype(logits2.scalar_type()));
  const char* x = static_cast<const char*>(logits2.data_ptr());
  const int64_t* y = labels1.data_ptr<int64_t>();
  char* l = static_cast<char*>(loss);
  char* g = grad.defined() ? static_cast<char*>(grad.data_ptr()) : nullptr;
  char* part = col_partial.defined() ? static_cast<char*>(col_partial.data_ptr()) : nullptr;
  const char* rs = row_scale.defined() ? static_cast<const char*>(row_scale.data_ptr()) : nullptr;
  auto run = [&](int64_t begin, int64_t end, void* col_sum) {
    const int64_t at = begin * classes * elem;
    cpu::cross_entropy_forward(dtype, x + at, y + begin, l + begin * acc,
                                        g ? g + at : nullptr, col_sum, end - begin, classes,
                                        ignore_index, label_smoothing, grad_scale,
                                        rs ? rs + begin * acc : nullptr);
  };
  if (!part) {
    at::parallel_for(0, rows, grain_rows(classes), [&](int64_t begin, int64_t end) {
      run(begin, end, nullptr);
    });
    return;
  }
  // Tasks cover whole reduction blocks, so each partial sum has exactly one writer.
  const int64_t blocks = (rows + kReduceBlockRows - 1) / kReduceBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kReduceBlockRows;
      run(begin, std::min(rows, begin + kReduceBlockRows), part + blk * classes * acc);
    }
  });
}

// The sum of n losses (contiguous, of dtype), in row order, so that it does not depend on the
// thread count.
double sum_of(const void* losses, at::ScalarType dtype, int64_t n) {
  double sum = 0.0;
  AT_DISPATCH_FLOATING_TYPES(dtype, "sum_of", [&] {
    const auto* l = static_cast<const scalar_t*>(losses);
    for (int64_t i = 0; i < n; ++i) sum += l[i];
  });
  return sum;
}

// The loss a mean or a sum returns, from the sum of the losses (rounded once, from float64,
// to the losses' dtype), as a 0-dim tensor written in place: a call's fixed cost counts at
// small sizes.
at::Tensor reduced(double sum, Reduction reduction, int64_t labelled,
                   const at::TensorOptions& options) {
  if (reduction == Reduction::kMean) sum /= double(std::max<int64_t>(labelled, 1));
  auto out = at::empty({}, options);
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "reduced",
                             [&] { *out.data_ptr<scalar_t>() = static_cast<scalar_t>(sum); });
  return out;
}

// The loss a reduction returns from the per-row losses (contiguous, accumulation dtype).
at::Tensor reduce_losses(const at::Tensor& losses, Reduction reduction, int64_t labelled) {
  if (reduction == Reduction::kNone) return losses;
  return reduced(sum_of(losses.data_ptr(), losses.scalar_type(), losses.numel()), reduction,
                 labelled, losses.options());
}

// src * scale in src's dtype, rounded once. scale (accumulation dtype) holds one value,
// or one per row of src viewed as [scale.numel(), -1].
at::Tensor scaled(const at::Tensor& src, const at::Tensor& scale) {
  if (!src.defined()) return src;
  auto in = src.contiguous();
  auto out = at::empty_like(in);
  const auto dtype = kernel_dtype(in);
  const size_t elem = in.element_size(), acc = scale.element_size();
  const char* s = static_cast<const char*>(scale.data_ptr());
  const char* x = static_cast<const char*>(in.data_ptr());
  char* y = static_cast<char*>(out.data_ptr());
  if (scale.numel() == 1) {
    at::parallel_for(0, in.numel(), 32768, [&](int64_t begin, int64_t end) {
      cpu::cross_entropy_scale_grad(dtype, x + begin * elem, y + begin * elem, 1,
                                             end - begin, s, 0);
    });
    return out;
  }
  const int64_t rows = scale.numel(), cols = in.numel() / std::max<int64_t>(rows, 1);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    cpu::cross_entropy_scale_grad(dtype, x + begin * cols * elem, y + begin * cols * elem,
                                           end - begin, cols, s + begin * acc, 1);
  });
  return out;
}

at::Tensor labelled_positions(const at::Tensor& labels1, int64_t classes, int64_t ignore_index) {
  auto positions = at::empty({count_labelled(labels1, classes, ignore_index)}, labels1.options());
  const int64_t* y = labels1.data_ptr<int64_t>();
  int64_t* next = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < labels1.numel(); ++i) {
    if (y[i] != ignore_index) *next++ = i;
  }
  return positions;
}

// The fused kernel on one chunk of masked_lm_loss, summing its gradient's columns per
// block of rows, then over the blocks.
at::Tensor chunk_cross_entropy(const at::Tensor& logits, const at::Tensor& labels1,
                               const at::Tensor& losses, bool with_grad, bool col_sum,
                               int64_t ignore_index, double label_smoothing, double grad_scale,
                               const at::Tensor& row_scale) {
  const auto acc = losses.scalar_type();
  const int64_t blocks = (logits.size(0) + kReduceBlockRows - 1) / kReduceBlockRows;
  auto partial = col_sum ? partial_sums(blocks, logits.size(1), acc) : at::Tensor();
  run_kernel(logits, labels1, losses.data_ptr(), with_grad ? logits : at::Tensor(), partial, ignore_index,
             label_smoothing, grad_scale, row_scale);
  return col_sum ? sum_partials(partial, 0, blocks, acc) : at::Tensor();
}

const MlmBackend kCpuMlm{check_cpu, labelled_positions, chunk_cross_entropy, reduce_losses,
                         scaled};

}  // namespace

// Softmax cross-entropy over the last dimension of logits. Returns (loss, grad): loss
// per reduction ("none": labels' shape), in float32 (float64 for float64 logits); grad,
// a new tensor shaped like logits, is d(loss)/d(logits) for grad_output 1 when with_grad,
// else empty.
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad) {
  const auto in = cross_entropy_inputs(logits, labels, reduction, check_cpu);
  kernel_dtype(logits);
  const int64_t labelled = count_labelled(in.labels, in.logits.size(1), ignore_index);
  // Outputs in their final shapes, contiguous (the kernel writes them as rows): an op's
  // output must not be a view.
  const auto acc_options = in.logits.options().dtype(acc_dtype(logits.scalar_type()));
  auto grad = with_grad ? at::empty(logits.sizes(), in.logits.options()) : at::Tensor();
  const double grad_scale =
      in.reduction == Reduction::kMean ? 1.0 / std::max<int64_t>(labelled, 1) : 1.0;
  auto run = [&](void* losses) {
    run_kernel(in.logits, in.labels, losses, grad, at::Tensor(), ignore_index, label_smoothing,
               grad_scale, at::Tensor());
  };
  at::Tensor loss;
  if (in.reduction == Reduction::kNone) {
    loss = at::empty(labels.sizes(), acc_options);
    run(loss.data_ptr());
  } else {  // (the rows' losses, only summed, need no tensor)
    const int64_t rows = in.logits.size(0);
    std::vector<char> losses(rows * c10::elementSize(acc_options.dtype().toScalarType()));
    run(losses.data());
    loss = reduced(sum_of(losses.data(), acc_options.dtype().toScalarType(), rows), in.reduction,
                   labelled, acc_options);
  }
  return {loss, with_grad ? grad : nothing(logits)};
}
FUSEDLM_KERNEL(cross_entropy_forward);

// d(logits): saved_grad scaled by grad (one value, or one per row for reduction "none").
at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& saved_grad,
                                  const std::string& reduction) {
  check_cross_entropy_grad(grad, saved_grad, reduction, check_cpu);
  return scaled(saved_grad, grad.to(acc_dtype(saved_grad.scalar_type())).contiguous());
}
FUSEDLM_KERNEL(cross_entropy_backward);

// DistilBERT's soft-target loss over the last dimension of student_logits and teacher_logits
// (one shape and dtype): T^2 * KL(softmax(teacher / T) || softmax(student / T)) per row.
// Returns (loss, grad) as cross_entropy_forward does ("mean": over the rows); grad is of the
// student logits only, and cross_entropy_backward scales it.
std::tuple<at::Tensor, at::Tensor> distillation_loss_forward(const at::Tensor& student_logits,
                                                             const at::Tensor& teacher_logits,
                                                             double temperature,
                                                             const std::string& reduction,
                                                             bool with_grad) {
  check_cpu(student_logits, "student_logits");
  check_cpu(teacher_logits, "teacher_logits");
  TORCH_CHECK_VALUE(student_logits.dim() >= 1 && student_logits.size(-1) > 0,
                    "student_logits must have a last dimension of at least one class, got shape ",
                    student_logits.sizes());
  TORCH_CHECK_VALUE(teacher_logits.sizes() == student_logits.sizes(),
                    "teacher_logits must have student_logits' shape ", student_logits.sizes(),
                    ", got ", teacher_logits.sizes());
  TORCH_CHECK_TYPE(teacher_logits.scalar_type() == student_logits.scalar_type(),
                   "teacher_logits must have student_logits' dtype");
  TORCH_CHECK_VALUE(temperature > 0 && std::isfinite(temperature),
                    "temperature must be a positive float, got ", temperature);
  const auto red = parse_reduction(reduction);
  const auto dtype = kernel_dtype(student_logits);
  const auto s = as_rows(student_logits), t = as_rows(teacher_logits);
  const int64_t rows = s.size(0), classes = s.size(1);
  auto losses = at::empty(student_logits.sizes().slice(0, student_logits.dim() - 1),
                          s.options().dtype(acc_dtype(student_logits.scalar_type())));
  auto grad = with_grad ? at::empty(student_logits.sizes(), s.options()) : at::Tensor();
  const double grad_scale = red == Reduction::kMean ? 1.0 / std::max<int64_t>(rows, 1) : 1.0;
  const size_t elem = s.element_size(), acc = losses.element_size();
  const char* x = static_cast<const char*>(s.data_ptr());
  const char* y = static_cast<const char*>(t.data_ptr());
  char* l = static_cast<char*>(losses.data_ptr());
  char* g = grad.defined() ? static_cast<char*>(grad.data_ptr()) : nullptr;
  at::parallel_for(0, rows, grain_rows(classes), [&](int64_t begin, int64_t end) {
    const int64_t at = begin * classes * elem;
    cpu::distillation_loss_forward(dtype, x + at, y + at, l + begin * acc,
                                            g ? g + at : nullptr, end - begin, classes,
                                            temperature, grad_scale);
  });
  return {reduce_losses(losses, red, rows), with_grad ? grad : nothing(student_logits)};
}
FUSEDLM_KERNEL(distillation_loss_forward);

// masked_lm_loss's entry points (csrc/masked_lm.h), on CPU tensors of a kernel dtype.
struct CpuGuard {
  CpuGuard(const at::Tensor& hidden, const char*) { kernel_dtype(hidden); }
};
constexpr auto masked_lm_loss_forward = &MaskedLmLoss<kCpuMlm, CpuGuard>::forward;
FUSEDLM_KERNEL(masked_lm_loss_forward);
constexpr auto masked_lm_loss_backward = &MaskedLmLoss<kCpuMlm, CpuGuard>::backward;
FUSEDLM_KERNEL(masked_lm_loss_backward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
