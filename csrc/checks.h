// The argument checks of the op entry points, shared by the CPU backend (csrc/) and the
// CUDA one (csrc/cuda/): shapes, dtypes and values, and the flattening of the inputs
// into the contiguous rows the kernels read (and the one host step both run alike, the
// FFN's second product). The two differ only in their device check,
// which each passes in; every other tensor must also lie on the first one's device.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace fusedlm {

// check_cpu or check_device_tensor (csrc/cuda/runtime.h): raises, naming the argument,
// unless t is on the backend's device.
using DeviceCheck = void (*)(const at::Tensor& t, const char* name);

inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* name,
                       const char* other);

// t [..., cols] as contiguous [rows, cols], rows the product of the other dimensions (a
// view when t is contiguous, t itself when it is already so: for inputs, never for outputs).
at::Tensor as_rows(const at::Tensor& t);

// An empty tensor: what a custom op returns for a result nobody asked for.
at::Tensor nothing(const at::Tensor& like);

// The checks every row-wise op makes (add_layer_norm, rms_norm), each raising with the
// argument's name:
// - t has a non-empty last dimension;
void check_rows(const at::Tensor& t, const char* name);
// - t has like's shape and dtype and lies on its device;
void check_like(const at::Tensor& t, const at::Tensor& like, const char* name, const char* other,
                DeviceCheck device);
// - t has x's dtype and lies on its device;
void check_operand(const at::Tensor& t, const at::Tensor& x, const char* name, DeviceCheck device);
// - t, where present, is [size] (or [hidden], x's last dimension) of x's dtype on its device:
//   returned contiguous, or undefined where absent;
at::Tensor vector_param(const std::optional<at::Tensor>& t, const at::Tensor& x, int64_t size,
                        const char* name, DeviceCheck device);
at::Tensor param(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name,
                 DeviceCheck device);
// - t is a forward's contiguous per-row statistic: `rows` values of `dtype`, on like's device.
void check_statistics(const at::Tensor& t, const char* name, int64_t rows, at::ScalarType dtype,
                      const at::Tensor& like, const char* other, DeviceCheck device);

// A row-wise op's inputs (add_layer_norm, rms_norm): x, on the backend's device with a
// non-empty last dimension, contiguous (read as [rows, cols] through its data; no view,
// whose dispatch a small call would pay for), and its [cols] weight (undefined where
// absent); for a backward also grad_out, of x's shape, dtype and device, contiguous.
struct RowInputs {
  at::Tensor x, weight, grad_out;
  int64_t rows, cols;
};
RowInputs row_inputs(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     DeviceCheck device);
RowInputs row_grad_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                          const std::optional<at::Tensor>& weight, DeviceCheck device);

// --- add_layer_norm -----------------------------------------------------------------------

// row_inputs', and the residual (x's shape, contiguous) and bias ([cols]), undefined where
// absent.
struct LayerNormInputs : RowInputs {
  at::Tensor residual, bias;
};
LayerNormInputs add_layer_norm_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, DeviceCheck device);

// The backward's: grad_out, grad_summed and summed as [rows, hidden], weight [hidden],
// mean and rstd contiguous [rows] of stat_dtype; and its outputs, summed's shape: dx under
// dropout, dsummed without dropout or with a residual (else undefined).
struct LayerNormGradInputs {
  at::Tensor grad_out, grad_summed, summed, weight;
  at::Tensor dsummed, dx;
};
LayerNormGradInputs add_layer_norm_grad_inputs(const at::Tensor& grad_out,
                                               const std::optional<at::Tensor>& grad_summed,
                                               const at::Tensor& summed, const at::Tensor& mean,
                                               const at::Tensor& rstd,
                                               const std::optional<at::Tensor>& weight,
                                               at::ScalarType stat_dtype, bool dropout,
                                               bool has_residual, DeviceCheck device);

// --- bias_gelu ----------------------------------------------------------------------------

// Whether `approximate` asks for GELU's tanh form ("tanh") rather than erf ("none"; the
// Python layer refuses other names).
bool gelu_tanh(const std::string& approximate);

// x (and, for the backward, grad, x's shape) as [rows, hidden], bias [hidden] or
// undefined, contiguous.
struct BiasGeluInputs {
  at::Tensor x, bias, grad;
  bool tanh;
};
BiasGeluInputs bias_gelu_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                const std::string& approximate, DeviceCheck device);
BiasGeluInputs bias_gelu_grad_inputs(const at::Tensor& grad, const at::Tensor& x,
                                     const std::optional<at::Tensor>& bias,
                                     const std::string& approximate, DeviceCheck device);

// --- gelu_ffn -----------------------------------------------------------------------------

// x as [rows, d_in], w1 [d_ff, d_in], w2 [d_out, d_ff], b1 [d_ff] and b2 [d_out] (undefined
// when absent), contiguous; for the backward also grad (x's shape but d_out last) as
// [rows, d_out] and pre_activation [rows, d_ff].
struct GeluFfnInputs {
  at::Tensor x, w1, b1, w2, b2, grad, pre_activation;
  bool tanh;
};
GeluFfnInputs gelu_ffn_inputs(const at::Tensor& x, const at::Tensor& w1,
                              const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                              const std::optional<at::Tensor>& b2, const std::string& approximate,
                              DeviceCheck device);
GeluFfnInputs gelu_ffn_grad_inputs(const at::Tensor& grad, const at::Tensor& x,
                                   const at::Tensor& pre_activation, const at::Tensor& w1,
                                   const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                                   const std::optional<at::Tensor>& b2,
                                   const std::string& approximate, DeviceCheck device);

// The FFN's second product, act w2^T (+ b2 when defined), both backends' (a matrix
// product): [..., d_out] with x's leading dimensions, allocated in that shape (an op's
// output is no view) and written through a [rows, d_out] view.
at::Tensor ffn_output(const at::Tensor& x, const at::Tensor& act, const at::Tensor& w2,
                      const at::Tensor& b2);

// The FFN backward's products, both backends' (ATen's): from the gradient g2 [rows, d_out],
// the activation act [rows, d_ff] and the pre-activation's gradient dpre [rows, d_ff].
// db2 is undefined without b2; dx has x's shape.
struct FfnGrads {
  at::Tensor dx, dw1, dw2, db2;
};
FfnGrads ffn_backward_products(const GeluFfnInputs& in, const at::Tensor& x, const at::Tensor& g2,
                               const at::Tensor& act, const at::Tensor& dpre);

// --- cross_entropy and masked_lm_loss -----------------------------------------------------

enum class Reduction { kNone, kMean, kSum };
// "none", "sum", else "mean" (the Python layer refuses other names).
Reduction parse_reduction(const std::string& reduction);

// logits as [rows, classes] and labels (int64, logits' shape but the last) as [rows].
struct CrossEntropyInputs {
  at::Tensor logits, labels;
  Reduction reduction;
};
CrossEntropyInputs cross_entropy_inputs(const at::Tensor& logits, const at::Tensor& labels,
                                        const std::string& reduction, DeviceCheck device);
// The backward's: saved_grad [..., classes] and grad, one value or (reduction "none")
// one per row.
void check_cross_entropy_grad(const at::Tensor& grad, const at::Tensor& saved_grad,
                              const std::string& reduction, DeviceCheck device);

// The masked-LM head's inputs, flattened and checked. `labelled` is left to the backend:
// finding the labelled rows is the one step that reads the labels.
struct MlmInputs {
  at::Tensor hidden;    // [rows, H]
  at::Tensor weight;    // [V, H]
  at::Tensor bias;      // [V] or undefined
  at::Tensor labels;    // [rows]
  at::Tensor labelled;  // int64 [n]: the rows whose label is not ignore_index
  int64_t ignore_index;
  double label_smoothing;
  int64_t chunk_rows;
};
MlmInputs mlm_inputs(const at::Tensor& hidden, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                     int64_t ignore_index, double label_smoothing, int64_t chunk_rows,
                     DeviceCheck device);

}  // namespace fusedlm
