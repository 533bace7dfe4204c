"""GPT against transformers' GPT-2 on the same weights, checkpoints both ways, training,
and generation over the KV cache."""
import json
import re
import textwrap

import pytest
import torch

import fusedlm
from fusedlm.models import GPTConfig, GPTLMHeadModel, GPTModel
from fusedlm.models.gpt import KVCache, filter_logits
from models_helpers import train
from test_readme import _python_block

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

MAX_RELATIVE_ERROR = 1e-4  # float32, norm-wise

pytestmark = pytest.mark.usefixtures("one_thread")




def _config(**changes):
    values = dict(vocab_size=101, n_positions=48, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return GPTConfig(**(values | changes))


def _relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _assert_near(actual, expected, name):
    error = _relative_error(actual, expected)
    assert error <= MAX_RELATIVE_ERROR, f"{name}: relative error {error:.3g}"


def _hf_copy(model, directory):
    """transformers' GPT2LMHeadModel loaded from the directory this model writes."""
    model.save_pretrained(directory)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager")
    return hf.train(model.training)


def _tokens(batch, seq, vocab):
    return torch.randint(2, vocab, (batch, seq))


def test_parity_with_transformers(tmp_path):
    model = GPTLMHeadModel(_config())
    hf = _hf_copy(model, tmp_path)
    ids = _tokens(3, 17, 101)
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding: the real tokens' outputs are defined in both

    out = model(ids, mask, labels=labels, return_logits=True)
    expected = hf(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    _assert_near(out.logits[real], expected.logits[real], "logits")
    hidden = model.transformer(ids, mask).last_hidden_state
    hf_hidden = hf.transformer(ids, attention_mask=mask).last_hidden_state
    _assert_near(hidden[real], hf_hidden[real], "last_hidden_state")

    # Loss and every parameter's gradient, without padding.
    out = model(ids, labels=labels)
    expected = hf(ids, labels=labels)
    _assert_near(out.loss, expected.loss, "loss")
    out.loss.backward()
    expected.loss.backward()
    ours = model.key_map.to_theirs({n: p.grad for n, p in model.named_parameters()})
    theirs = dict(hf.named_parameters())
    assert set(ours) == set(theirs)
    for name, grad in ours.items():
        _assert_near(grad, theirs[name].grad, f"grad of {name}")


def test_training_with_labels_builds_no_logits():
    model = GPTLMHeadModel(_config()).train()
    ids = _tokens(2, 9, 101)
    out = model(ids, labels=ids)
    assert out.logits is None and out.loss is not None  # the fused loss never built them
    assert model(ids, labels=ids, return_logits=True).logits.shape == (2, 9, 101)
    assert model.eval()(ids, labels=ids).logits.shape == (2, 9, 101)


def test_gpt_model_loads_transformers_gpt2_model(tmp_path):
    ids = _tokens(2, 9, 101)
    hf_body = transformers.GPT2Model(transformers.GPT2Config(**_hf_fields(_config())))
    hf_body.save_pretrained(tmp_path)
    body = GPTModel.from_pretrained(tmp_path)
    _assert_near(body(ids).last_hidden_state, hf_body(ids).last_hidden_state, "last_hidden_state")


@pytest.mark.parametrize("setting", [dict(scale_attn_by_inverse_layer_idx=True),
                                     dict(scale_attn_weights=False, n_inner=40)],
                         ids=["inverse_layer_scale", "unscaled_n_inner"])
def test_parity_with_transformers_attention_settings(tmp_path, setting):
    model = GPTLMHeadModel(_config(**setting)).eval()
    hf = _hf_copy(model, tmp_path)
    ids = _tokens(2, 13, 101)
    _assert_near(model(ids).logits, hf(ids).logits, "logits")
    for name, value in setting.items():
        assert getattr(hf.config, name) == value


def _hf_fields(config):
    return {k: v for k, v in config.to_dict().items() if k != "model_type"}


def test_loads_transformers_checkpoints_with_old_mask_buffers(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**_hf_fields(_config())))
    hf.save_pretrained(tmp_path)
    # Older files carry each layer's causal mask as buffers: they are skipped.
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["transformer.h.0.attn.bias"] = torch.ones(1, 1, 48, 48)
    weights["transformer.h.1.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = GPTLMHeadModel.from_pretrained(tmp_path).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = _tokens(2, 11, 101)
    _assert_near(model(ids).logits, hf.eval()(ids).logits, "logits")
    # And back: what fusedlm writes, transformers reads to the same tensors.
    model.save_pretrained(tmp_path / "again")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "again")
    for name, p in hf.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], p, rtol=0, atol=0, msg=name)
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_embd"] == 32


def test_checkpoint_of_the_wrong_shape_names_the_tensor(tmp_path):
    GPTLMHeadModel(_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        GPTLMHeadModel.from_pretrained(tmp_path, config=_config(n_positions=40))


# --- training ------------------------------------------------------------------------------------

def _corpus() -> torch.Tensor:
    """Byte-level tokens of some of the standard library's docstrings."""
    text = "\n".join(m.__doc__ for m in (json, re, textwrap, torch.nn.Module))
    return torch.tensor(list(text.encode()), dtype=torch.long)


def _batch(corpus, generator, batch=16, seq=32):
    starts = torch.randint(0, corpus.numel() - seq, (batch,), generator=generator)
    ids = torch.stack([corpus[s:s + seq] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids}


def _train(steps, backend=None, seed=0):
    torch.manual_seed(seed)
    model = GPTLMHeadModel(_config(vocab_size=256, n_embd=48, n_positions=32))
    corpus = _corpus()
    return train(model, lambda generator: _batch(corpus, generator), steps, backend, seed=seed)


def test_the_model_trains():
    losses = _train(60)
    assert sum(losses[-10:]) / 10 < 0.8 * losses[0], losses[::10]


def test_training_on_cpu_follows_the_reference():
    cpu, ref = _train(20, "cpu"), _train(20, "reference")
    torch.testing.assert_close(torch.tensor(cpu), torch.tensor(ref), rtol=2e-3, atol=0)


def test_gradient_checkpointing_replays_dropout():
    config = _config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    ids = _tokens(2, 15, 101)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPTLMHeadModel(config).train()
        if checkpointed:
            model.gradient_checkpointing_enable()
        torch.manual_seed(1)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append([loss] + [p.grad for p in model.parameters()])
    dropped = GPTLMHeadModel(config).eval()
    assert grads[0][0] != dropped(ids, labels=ids).loss  # dropout did act
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_autocast_bfloat16():
    model = GPTLMHeadModel(_config()).train()
    ids = _tokens(2, 13, 101)
    full = model(ids, labels=ids, return_logits=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids, labels=ids, return_logits=True)
    assert low.logits.dtype == torch.bfloat16
    assert abs(low.loss.item() - full.loss.item()) < 2e-2 * full.loss.item()
    low.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in model.parameters())


# --- generation ----------------------------------------------------------------------------------

def _generator_model():
    """A model whose greedy continuations vary with the context: at GPT-2's initial scale a
    tiny model mostly repeats its last token, which no position or padding error changes."""
    return GPTLMHeadModel(_config(initializer_range=0.5)).eval()


def _left_padded(vocab=101):
    ids = _tokens(3, 7, vocab)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def test_greedy_generation_with_cache_equals_recomputation_and_transformers(tmp_path):
    model = _generator_model()
    hf = _hf_copy(model, tmp_path).eval()
    ids, mask = _left_padded()
    cached = model.generate(ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    recomputed = model.generate(ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0,
                                use_cache=False)
    hf.generation_config.eos_token_id = None  # no stop token, as eos_token_id=[] here
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    assert cached.shape == (3, 19)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, expected)

    # Per-sequence stopping at a token sequence 0 produces at its third step.
    stop = int(cached[0, 9])
    stopped = model.generate(ids, mask, max_new_tokens=12, eos_token_id=stop, pad_token_id=0)
    hf_stopped = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             eos_token_id=stop, pad_token_id=0)
    assert torch.equal(stopped, hf_stopped)
    first_stop = (cached[0, 7:] == stop).nonzero()[0].item() + 7
    assert (stopped[0, first_stop + 1:] == 0).all()


def test_sampling_is_reproducible_and_filters():
    model = _generator_model()
    ids, mask = _left_padded()

    def sample(seed, **options):
        g = torch.Generator().manual_seed(seed)
        return model.generate(ids, mask, max_new_tokens=10, do_sample=True, eos_token_id=[],
                              generator=g, **options)

    assert torch.equal(sample(3, temperature=1.5), sample(3, temperature=1.5))
    assert not torch.equal(sample(3, temperature=5.0), sample(4, temperature=5.0))
    greedy = model.generate(ids, mask, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(sample(5, top_k=1), greedy)
    assert torch.equal(sample(5, top_p=1e-6), greedy)

    # Each token drawn with top_k=3 is among the 3 most likely after its prefix.
    tokens = sample(6, top_k=3, temperature=3.0)
    full_mask = torch.cat([mask, torch.ones(3, 10, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(tokens, full_mask, positions).logits[:, 6:-1]  # predicting tokens 7..
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens[:, 7:, None]).any(-1).all()

    logits = torch.randn(4, 50)
    kept = filter_logits(logits, top_k=7).isfinite()
    assert torch.equal(kept, logits >= logits.topk(7).values[:, -1:])
    probs = logits.softmax(-1)
    kept = filter_logits(logits, top_p=0.6).isfinite()
    for row, keep in zip(probs, kept):
        inside = row[keep]
        # The kept tokens are the most probable ones, reach 0.6, and need their last one.
        assert inside.min() >= row[~keep].max()
        assert inside.sum() >= 0.6 and inside.sum() - inside.min() < 0.6


def test_generation_under_torch_compile_matches():
    # One decoding step through attention_with_kvcache traces without graph breaks.
    model = GPTLMHeadModel(_config()).eval()
    ids = _tokens(2, 5, 101)
    with torch.no_grad():
        caches = [KVCache.empty(model.config, 2, 8, model.lm_head.weight) for _ in range(2)]
        for cache in caches:
            model(ids, kv_cache=cache)
            cache.seqlens += 5
        step = torch.compile(lambda t, c: model(t, kv_cache=c).logits, fullgraph=True)
        nxt = ids[:, -1:]
        torch.testing.assert_close(step(nxt, caches[0]), model(nxt, kv_cache=caches[1]).logits)


# --- bad input -----------------------------------------------------------------------------------

def test_errors_name_the_argument():
    model = GPTLMHeadModel(_config()).eval()
    ids = _tokens(2, 5, 101)
    with pytest.raises(ValueError, match="n_embd"):
        _config(n_embd=30)
    with pytest.raises(ValueError, match="activation_function"):
        _config(activation_function="relu")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        _config(tie_word_embeddings=False)
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="input_ids"):
        model(_tokens(1, 49, 101))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, 1:])
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=torch.arange(4)[None])
    right_padded = torch.ones_like(ids)
    right_padded[0, -1] = 0
    all_padding = torch.ones_like(ids)
    all_padding[1] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, torch.ones_like(ids), kv_cache=KVCache.empty(model.config, 2, 8, ids.float()))
    bad = [({"attention_mask": right_padded}, "attention_mask"),
           ({"attention_mask": all_padding}, "attention_mask"),
           ({"max_new_tokens": 0}, "max_new_tokens"),
           ({"max_new_tokens": 44}, "max_new_tokens"),
           ({"temperature": 0.0}, "temperature"),
           ({"top_k": 0}, "top_k"),
           ({"top_p": 1.5}, "top_p")]
    for options, name in bad:
        with pytest.raises(ValueError, match=name):
            model.generate(ids, **({"max_new_tokens": 3} | options))


def test_readme_example_runs():
    scope = {}
    exec(compile(_python_block("GPT"), "README.md", "exec"), scope)
    assert scope["out"].shape == (4, 24) and scope["loss"].item() > 0


def test_exported_names():
    assert {"GPTConfig", "GPTModel", "GPTLMHeadModel"} <= set(fusedlm.models.__all__)
