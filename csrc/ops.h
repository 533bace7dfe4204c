// The CPU backend's op entry points, bound to Python in pyext/module.cpp.
//
// Each takes and returns at::Tensor, validates what the kernels rely on, and
// splits the work over ATen's thread pool. Argument checking with names and
// messages for users happens first in the Python layer (python/fusedlm/ops).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusedlm {

// Which kernel table is in use, and the ones this processor can run.
std::string cpu_capability();
void set_cpu_capability(const std::string& isa);
std::vector<std::string> supported_cpu_capabilities();

// The keep mask (bool, `shape`) of the dropout stream (seed, offset).
at::Tensor dropout_mask(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape, double p);

// gelu(x + bias) over the last dimension; bias may be absent.
at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate);
// (dx, dbias); dbias is undefined when bias is absent.
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate);

// Linear -> GELU -> dropout -> Linear. Returns (y, pre_activation), the latter
// x @ w1^T without its bias, the one activation the backward needs.
std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed);
// (dx, dw1, db1, dw2, db2); the bias gradients are undefined when a bias is absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed);

// summed = dropout(x) + residual and out = layer_norm(summed) over the last dimension;
// residual, weight and bias may be absent. Returns (out, summed, mean, rstd), the
// latter two [rows] in float32 (float64 for float64 inputs): the statistics of summed
// as returned, saved for the backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed);
// (dsummed, dx, dweight, dbias). dsummed is the gradient of summed (grad_summed, which may be
// absent, plus what flows back through the norm): the residual's gradient, and x's too
// without dropout, when dx is undefined. Under dropout dx = dsummed through the mask, and
// dsummed is defined only when has_residual. dweight and dbias are undefined when absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed);

}  // namespace fusedlm
