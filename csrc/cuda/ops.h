// The cuda backend's op entry points (csrc/cuda/*.cu, their kernels in kernels/cuda/*.cuh),
// bound to Python as fusedlm._C.cuda in pyext/module.cpp when the extension is built with CUDA.
//
// Each takes and returns exactly what the CPU entry point of the same name in csrc/ops.h
// does (see there), for CUDA tensors of float32, bfloat16 or float16; the statistics and
// losses they return are float32. Kernels run on the inputs' device, on PyTorch's current
// stream.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusedlm::cuda {

// The keep mask (bool, `shape`, on CUDA device `device_index`) of the dropout stream
// (seed, offset) as the CUDA kernels draw it.
at::Tensor dropout_mask(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape, double p,
                        int64_t device_index);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed);

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate);
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate);

// bfloat16 and float16, d_in, d_ff and d_out multiples of 8. The saved pre-activation
// includes b1 (the CPU entry point's does not): each backend's backward reads its own.
std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed);

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad);
at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& saved_grad,
                                  const std::string& reduction);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
    bool need_dbias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
    const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias);

// bfloat16 and float16, head_dim 64 or 128 for q, k and v alike, no attn_bias (the
// Python limits route other calls elsewhere). lse is float32. The backward is
// deterministic: every gradient element is written by one block, without atomics.
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, double dropout_p, double scale, const at::Tensor& seed);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p, double scale,
    const at::Tensor& seed, bool bias_grad);
std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed);

}  // namespace fusedlm::cuda
