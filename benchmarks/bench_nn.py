"""A BERT-base TransformerEncoderLayer training step on the CPU: fusedlm.nn against torch.nn.

Batch 8, seq 128, hidden 768, 12 heads, FFN 3072, GELU, post-LN, dropout 0.1, float32,
batch_first; each sequence's length is uniform in [64, 128] and given as a bool
src_key_padding_mask. Both layers hold the same weights. torch runs its training path
(masked attention over the padded batch); fusedlm packs the real tokens, so every
product skips the padding (about 3/4 of the tokens are real).
"""
import pytest
import torch
from torch import nn

import fusedlm.nn
from conftest import BATCH, FFN, HEADS, HIDDEN, SEQ, role


@pytest.mark.parametrize("impl", ["fusedlm", "torch"])
def test_encoder_layer_training_step(benchmark, impl):
    role(benchmark, f"TransformerEncoderLayer forward+backward float32 "
                    f"[{BATCH}x{SEQ}x{HIDDEN}, {HEADS} heads, FFN {FFN}] padding", impl)
    torch_layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.1, activation="gelu",
                                             batch_first=True)
    layer = torch_layer
    if impl == "fusedlm":
        layer = fusedlm.nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.1,
                                                   activation="gelu", batch_first=True)
        layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,))
    padding = torch.arange(SEQ)[None, :] >= lengths[:, None]
    grad = torch.randn(BATCH, SEQ, HIDDEN)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x, src_key_padding_mask=padding).backward(grad)

    benchmark(step)
