"""A Hugging Face BERT-base masked-LM training step, patched by fusedlm.patch vs unpatched.

One step is forward + backward of BertForMaskedLM (randomly initialised, dropout as
configured) on batch 8 x seq 128 with 15% of the tokens labelled, no padding. The
unpatched model runs transformers' default attention (SDPA). A step takes seconds on
a few CPU cores, so each side runs a few rounds only.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedlm  # noqa: E402
from conftest import BATCH, FFN, HEADS, HIDDEN, SEQ, VOCAB, role  # noqa: E402

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="no CUDA device"))]
_MODELS = {}


def _models(device):
    """(unpatched, patched) BERT-base with the same weights, built once per device."""
    if device not in _MODELS:
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                         intermediate_size=FFN, num_hidden_layers=12)
        model = transformers.BertForMaskedLM(config).to(device).train()
        _MODELS[device] = {"transformers": model,
                           "fusedlm": fusedlm.patch(copy.deepcopy(model))}
    return _MODELS[device]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "transformers"])
def test_bert_base_mlm_training_step(benchmark, device, impl):
    role(benchmark, f"BERT-base MLM training step {device} [{BATCH}x{SEQ}, 15% labelled]", impl)
    model = _models(device)[impl]
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    labels = ids.masked_fill(torch.rand(ids.shape, device=device) >= 0.15, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=3, warmup_rounds=1, iterations=1)
