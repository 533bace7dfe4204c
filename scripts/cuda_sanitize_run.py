"""One small run of every cuda-backend kernel, forward and backward, for compute-sanitizer.

    compute-sanitizer --tool memcheck python scripts/cuda_sanitize_run.py

Shapes take each kernel through its vector and one-element paths, rows longer than the
layer norm's register cache, dropout, ignored labels, the masked-LM chunks, and the
attention and FFN kernels' partial blocks. It checks
no values (the tests do): it exits non-zero when the cuda backend cannot run.
"""
import importlib
import itertools
import sys

import torch

import fusedlm
from fusedlm.backends import cuda as cuda_backend
ce_module = importlib.import_module("fusedlm.ops.cross_entropy")  # the module, not the op it exports


def grads(outputs, inputs):
    present = [t for t in inputs if t is not None]
    used = [o for o in outputs if o.requires_grad]
    torch.autograd.grad(used, present, [torch.randn_like(o) for o in used])


def main() -> int:
    status = fusedlm.backends()["cuda"]
    if status is not True:
        print(f"the cuda backend cannot run: {status}", file=sys.stderr)
        return 1
    cuda = dict(device="cuda", requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        # add_layer_norm: 64 (vectors), 33 (one element per load), 9000 (past the cache).
        for hidden in (64, 33, 9000):
            x, r = (torch.randn(5, hidden, dtype=dtype, **cuda) for _ in range(2))
            w, b = (torch.randn(hidden, dtype=dtype, **cuda) for _ in range(2))
            for p in (0.0, 0.2):
                grads(fusedlm.ops.add_layer_norm(x, r, w, b, dropout_p=p, backend="cuda"), (x, r, w, b))
        # bias_gelu
        for width in (64, 33):
            x = torch.randn(40, width, dtype=dtype, **cuda)
            b = torch.randn(width, dtype=dtype, **cuda)
            for approximate in ("none", "tanh"):
                grads([fusedlm.ops.bias_gelu(x, b, approximate, backend="cuda")], (x, b))
        # cross_entropy: 203 classes (unaligned rows), ignored labels, label smoothing.
        logits = torch.randn(7, 203, dtype=dtype, **cuda)
        labels = torch.tensor([0, 5, -100, 202, 17, -100, 100], device="cuda")
        for reduction in ("mean", "none"):
            loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=0.1,
                                             reduction=reduction, backend="cuda")
            grads([loss], (logits,))
        # masked_lm_loss in chunks of 2 rows.
        hidden = torch.randn(7, 16, dtype=dtype, **cuda)
        weight = torch.randn(203, 16, dtype=dtype, **cuda)
        bias = torch.randn(203, dtype=dtype, **cuda)
        saved = ce_module.LOGITS_CHUNK_BYTES
        ce_module.LOGITS_CHUNK_BYTES = 2 * 203 * hidden.element_size()
        try:
            for reduction in ("sum", "none"):
                loss = fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels, reduction=reduction,
                                                  backend="cuda")
                grads([loss], (hidden, weight, bias))
        finally:
            ce_module.LOGITS_CHUNK_BYTES = saved
    # attention: head dims 64 and 128, query and key tails past a block of 64, padding,
    # the causal diagonal with more queries than keys, dropout; the resident path (up to
    # 512) and the streamed one, whose forward runs on wgmma on sm_90 unless turned off;
    # the one-kernel backward of one chunk of keys and of three, and the three kernels
    # past 512 keys; varlen with an empty sequence.
    cases = ((64, 70, 67, True), (128, 70, 67, True), (64, 300, 260, True),
             (64, 603, 600, True), (128, 603, 600, True), (64, 603, 600, False))
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim, seq_q, seq_k, wgmma in cases:
            cuda_backend.set_path("attention_wgmma", wgmma)
            q = torch.randn(2, seq_q, 2, head_dim, dtype=dtype, **cuda).transpose(1, 2)
            k, v = (torch.randn(2, 2, seq_k, head_dim, dtype=dtype, **cuda) for _ in range(2))
            mask = torch.rand(2, seq_k, device="cuda") < 0.3
            for causal, p in ((False, 0.0), (True, 0.1)):
                out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, causal=causal,
                                            dropout_p=p, backend="cuda")
                grads([out], (q, k, v))
            cu_q = torch.tensor([0, 5, 5, 75], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 66, 70, 79], dtype=torch.int32, device="cuda")
            q, k, v = (torch.randn(n, 2, head_dim, dtype=dtype, **cuda) for n in (75, 79, 79))
            out = fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, 70, 66, causal=True,
                                               dropout_p=0.1, backend="cuda")
            grads([out], (q, k, v))
    # gelu_ffn: partial 128-row and 128-column blocks, a K tail inside a 32-wide (64-wide
    # on wgmma) step, and K longer than the 3-stage pipeline; with and without biases and
    # dropout; cuBLAS's products with the GELU passes, and the fused product on wgmma
    # (sm_90) and on mma.sync.
    products = ((True, True), (False, True), (False, False))  # (ffn_cublas, ffn_wgmma)
    for dtype, (cublas, wgmma) in itertools.product((torch.bfloat16, torch.float16), products):
        cuda_backend.set_path("ffn_cublas", cublas)
        cuda_backend.set_path("ffn_wgmma", wgmma)
        for rows, d_in, d_ff, d_out in ((130, 48, 136, 40), (7, 264, 256, 136)):
            x = torch.randn(rows, d_in, dtype=dtype, **cuda)
            w1 = torch.randn(d_ff, d_in, dtype=dtype, **cuda)
            w2 = torch.randn(d_out, d_ff, dtype=dtype, **cuda)
            b1, b2 = torch.randn(d_ff, dtype=dtype, **cuda), torch.randn(d_out, dtype=dtype, **cuda)
            for biases, approximate, p in (((b1, b2), "none", 0.0), ((None, None), "tanh", 0.1)):
                out = fusedlm.ops.gelu_ffn(x, w1, biases[0], w2, biases[1],
                                           approximate=approximate, dropout_p=p, backend="cuda")
                grads([out], (x, w1, *biases, w2))
    fusedlm._C.cuda.dropout_mask(torch.tensor(3), 5, [3, 7], 0.5, torch.cuda.current_device())
    torch.cuda.synchronize()
    print("ran every cuda kernel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
