// lstm_cell on the CPU: the pointwise part of an LSTM step (AllenNLP's
// LstmCellWithProjection, with its cell clip), forward and backward, one pass over memory
// each, split over rows of the batch.
//
// Forward reads the 4 * cell gate pre-activations and c_prev and writes h and c: 7 elements
// moved per cell unit. Backward reads dh, dc, the gates and c_prev and writes dgates and
// dc_prev (12 per unit); it recomputes the activations rather than have the forward store
// them, which would cost 4 more elements per unit in each direction.
#include "kernel.h"

#ifdef FUSEDLM_ISA
#include "math.h"
#else
#include "ops/compiled_kernel.h"
#include "checks.h"
#include "common.h"
#endif

// The pointwise part of an LSTM step over rows x cell, row-major: gates [rows, 4 * cell]
// holds the pre-activations of the input, forget, cell and output gates in that order;
// c = clamp(i * g + f * c_prev, -clip, clip) and h = o * tanh(c) (clip may be +inf).
FUSEDLM_CPU_KERNEL(lstm_cell_forward, void(DType, const void* gates, const void* c_prev, void* h,
                                           void* c, int64_t rows, int64_t cell, double clip))

// dgates and dc_prev from dh and dc (the gradient of the returned c), recomputing the
// activations from gates and c_prev; the clip passes gradient only inside [-clip, clip].
FUSEDLM_CPU_KERNEL(lstm_cell_backward, void(DType, const void* dh, const void* dc,
                                            const void* gates, const void* c_prev, void* dgates,
                                            void* dc_prev, int64_t rows, int64_t cell, double clip))

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

// One row. The inner loops have no branches (the clip is a pair of selects, +inf when off)
// and their pointers are __restrict__ (GCC will not version a loop over this many
// streams for aliasing), so that they vectorise.
template <typename T, typename A = acc_t<T>>
void forward_row(const T* __restrict__ gi, const T* __restrict__ gf, const T* __restrict__ gg,
                 const T* __restrict__ go, const T* __restrict__ c_prev, T* __restrict__ h,
                 T* __restrict__ c, int64_t cell, A hi) {
  for (int64_t k = 0; k < cell; ++k) {
    A i = sigmoid(load(gi[k])), f = sigmoid(load(gf[k]));
    A g = tanh_(load(gg[k])), o = sigmoid(load(go[k]));
    A cn = i * g + f * load(c_prev[k]);
    cn = cn > hi ? hi : cn;
    cn = cn < -hi ? -hi : cn;
    store(c[k], cn);
    store(h[k], o * tanh_(cn));
  }
}

template <typename T, typename A = acc_t<T>>
void backward_row(const T* __restrict__ dh, const T* __restrict__ dc, const T* __restrict__ gi,
                  const T* __restrict__ gf, const T* __restrict__ gg, const T* __restrict__ go,
                  const T* __restrict__ c_prev, T* __restrict__ di, T* __restrict__ df,
                  T* __restrict__ dg, T* __restrict__ dout, T* __restrict__ dc_prev,
                  int64_t cell, A hi) {
  for (int64_t k = 0; k < cell; ++k) {
    // Each gate's 1 - sigmoid and 1 - tanh^2 computed directly (math.h), not from the
    // rounded activation, where they would cancel.
    A i, i_rest, f, f_rest, o, o_rest;
    sigmoid_both(load(gi[k]), i, i_rest);
    sigmoid_both(load(gf[k]), f, f_rest);
    sigmoid_both(load(go[k]), o, o_rest);
    const A gate = load(gg[k]), g = tanh_(gate);
    A prev = load(c_prev[k]);
    A raw = i * g + f * prev;
    // As torch.clamp: the gradient passes where -hi <= raw <= hi (bounds included).
    A inside = A((raw >= -hi) & (raw <= hi));
    A cn = raw > hi ? hi : raw;
    cn = cn < -hi ? -hi : cn;
    A t = tanh_(cn);
    A grad_h = load(dh[k]);
    A grad_c = (load(dc[k]) + grad_h * o * tanh_grad(cn)) * inside;
    store(di[k], grad_c * g * i * i_rest);
    store(df[k], grad_c * prev * f * f_rest);
    store(dg[k], grad_c * i * tanh_grad(gate));
    store(dout[k], grad_h * t * o * o_rest);
    store(dc_prev[k], grad_c * f);
  }
}

}  // namespace

void lstm_cell_forward(DType dtype, const void* gates, const void* c_prev, void* h, void* c,
                       int64_t rows, int64_t cell, double clip) {
  const FlushSubnormals flush;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* g = static_cast<const T*>(gates);
    for (int64_t r = 0; r < rows; ++r) {
      const T* gr = g + r * 4 * cell;
      const int64_t at = r * cell;
      forward_row<T>(gr, gr + cell, gr + 2 * cell, gr + 3 * cell,
                     static_cast<const T*>(c_prev) + at, static_cast<T*>(h) + at,
                     static_cast<T*>(c) + at, cell, acc_t<T>(clip));
    }
  });
}

void lstm_cell_backward(DType dtype, const void* dh, const void* dc, const void* gates,
                        const void* c_prev, void* dgates, void* dc_prev, int64_t rows,
                        int64_t cell, double clip) {
  const FlushSubnormals flush;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* g = static_cast<const T*>(gates);
    T* dg = static_cast<T*>(dgates);
    for (int64_t r = 0; r < rows; ++r) {
      const T* gr = g + r * 4 * cell;
      T* dgr = dg + r * 4 * cell;
      const int64_t at = r * cell;
      backward_row<T>(static_cast<const T*>(dh) + at, static_cast<const T*>(dc) + at, gr,
                      gr + cell, gr + 2 * cell, gr + 3 * cell, static_cast<const T*>(c_prev) + at,
                      dgr, dgr + cell, dgr + 2 * cell, dgr + 3 * cell,
                      static_cast<T*>(dc_prev) + at, cell, acc_t<T>(clip));
    }
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA

#else  // the host role: entry points

namespace fusedlm {
namespace {

// gates as [rows, 4 * cell] and c_prev as [rows, cell], contiguous, of one dtype.
struct LstmRows {
  at::Tensor gates, c_prev;
  int64_t rows, cell;
};

LstmRows lstm_rows(const at::Tensor& gates, const at::Tensor& c_prev) {
  check_cpu(gates, "gates");
  check_cpu(c_prev, "c_prev");
  TORCH_CHECK_TYPE(gates.scalar_type() == c_prev.scalar_type(), "gates and c_prev must share a dtype");
  LstmRows in{as_rows(gates), as_rows(c_prev), 0, 0};
  in.rows = in.c_prev.size(0);
  in.cell = in.c_prev.size(1);
  TORCH_CHECK_VALUE(in.gates.size(0) == in.rows && in.gates.size(1) == 4 * in.cell,
                    "gates must have shape [rows, 4 * cell] for c_prev [rows, cell]");
  return in;
}

// A gradient of h or c: c_prev's shape, as contiguous rows of c_prev's dtype.
at::Tensor grad_rows(const at::Tensor& grad, const at::Tensor& c_prev, const char* name) {
  check_cpu(grad, name);
  TORCH_CHECK_VALUE(grad.sizes() == c_prev.sizes(), name, " must have c_prev's shape");
  return as_rows(grad.to(c_prev.scalar_type()));
}

// Row `row` of t seen as rows of `width` elements.
char* row_at(const at::Tensor& t, int64_t row, int64_t width) {
  return static_cast<char*>(t.data_ptr()) + row * width * t.element_size();
}

// Calls f(begin, end) over the rows in tasks of near 64 KiB of gate pre-activations.
template <typename F>
void for_rows(const LstmRows& in, F&& f) {
  at::parallel_for(0, in.rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(in.cell, 1)), f);
}

}  // namespace

// The pointwise part of an LSTM step: gates [..., 4 * cell] (input, forget, cell, output
// pre-activations), c_prev [..., cell]. Returns (h, c), c clipped to [-cell_clip, cell_clip]
// (cell_clip +inf: no clip).
std::tuple<at::Tensor, at::Tensor> lstm_cell_forward(const at::Tensor& gates,
                                                     const at::Tensor& c_prev, double cell_clip) {
  const auto in = lstm_rows(gates, c_prev);
  const auto dtype = kernel_dtype(c_prev);
  // Outputs in c_prev's shape, contiguous (the kernels write them as rows): an op's output
  // must not be a view.
  auto h = at::empty(c_prev.sizes(), in.c_prev.options());
  auto c = at::empty(c_prev.sizes(), in.c_prev.options());
  const int64_t cell = in.cell;
  for_rows(in, [&](int64_t begin, int64_t end) {
    cpu::lstm_cell_forward(dtype, row_at(in.gates, begin, 4 * cell),
                                    row_at(in.c_prev, begin, cell), row_at(h, begin, cell),
                                    row_at(c, begin, cell), end - begin, cell, cell_clip);
  });
  return {h, c};
}
FUSEDLM_KERNEL(lstm_cell_forward);

// (dgates, dc_prev) from the gradients of h and c.
std::tuple<at::Tensor, at::Tensor> lstm_cell_backward(const at::Tensor& grad_h,
                                                      const at::Tensor& grad_c,
                                                      const at::Tensor& gates,
                                                      const at::Tensor& c_prev, double cell_clip) {
  const auto in = lstm_rows(gates, c_prev);
  const auto dtype = kernel_dtype(c_prev);
  const auto dh = grad_rows(grad_h, c_prev, "grad_h"), dc = grad_rows(grad_c, c_prev, "grad_c");
  auto dgates = at::empty(gates.sizes(), in.gates.options());
  auto dc_prev = at::empty(c_prev.sizes(), in.c_prev.options());
  const int64_t cell = in.cell;
  for_rows(in, [&](int64_t begin, int64_t end) {
    cpu::lstm_cell_backward(dtype, row_at(dh, begin, cell), row_at(dc, begin, cell),
                                     row_at(in.gates, begin, 4 * cell),
                                     row_at(in.c_prev, begin, cell), row_at(dgates, begin, 4 * cell),
                                     row_at(dc_prev, begin, cell), end - begin, cell, cell_clip);
  });
  return {dgates, dc_prev};
}
FUSEDLM_KERNEL(lstm_cell_backward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
