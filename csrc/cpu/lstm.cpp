// The pointwise part of an LSTM step (AllenNLP's LstmCellWithProjection, with its cell clip),
// forward and backward, one pass over memory each.
//
// Forward reads the 4 * cell gate pre-activations and c_prev and writes h and c: 7 elements
// moved per cell unit. Backward reads dh, dc, the gates and c_prev and writes dgates and
// dc_prev (12 per unit); it recomputes the activations rather than have the forward store
// them, which would cost 4 more elements per unit in each direction.
#include "math.h"

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
