"""``attn_implementation="fusedlm"`` in transformers' own models, against
``attn_implementation="sdpa"`` on the same tiny random weights: Llama (grouped-query),
Mistral (sliding window), Qwen2 (multi-query, sliding and full layers), Gemma
(multi-query), GPT-NeoX, ModernBERT (local and global layers), GPT-2 and the BERT family. Padded batches: outputs at the real
tokens, the training loss and every gradient, and generate's tokens (greedy and beam), on
every backend that runs here; and the registration at import, the masks transformers
builds, and what falls back or is refused."""
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedlm  # noqa: E402
from fusedlm.patching import hf_attention  # noqa: E402

from helpers import backend_device, backends_for, slow_backend  # noqa: E402

VOCAB, SEQ, PAD = 100, 24, 0
WINDOW = 5  # Mistral's and Qwen2's sliding window, and ModernBERT's half window: under SEQ
LENGTHS = (SEQ, SEQ - 9, 6)


def _config(family):
    decoder = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
                   attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **decoder)
    if family == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW, **decoder)
    if family == "qwen2":  # its second layer slides, its first does not
        return transformers.Qwen2Config(num_key_value_heads=1, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=1, **decoder)
    if family == "gemma":  # multi-query
        return transformers.GemmaConfig(num_key_value_heads=1, head_dim=16, **decoder)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
            rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0)
    if family == "modernbert":  # global, local, global
        return transformers.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
            local_attention=2 * WINDOW, global_attn_every_n_layers=2)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=64, pad_token_id=PAD, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "distilbert":
        return transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                                             hidden_dim=96, max_position_embeddings=64,
                                             pad_token_id=PAD, dropout=0.0, attention_dropout=0.0)
    cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig,
           "electra": transformers.ElectraConfig, "albert": transformers.AlbertConfig}[family]
    extra = {"embedding_size": 32} if family in ("electra", "albert") else {}
    return cls(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=96, max_position_embeddings=64, pad_token_id=PAD,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)


CAUSAL = ("llama", "mistral", "qwen2", "gemma", "gpt_neox", "gpt2")
# On the backends that imitate a GPU here (Triton's interpreter, the CUDA emulator), one
# family for each kind of attention call: grouped heads, a causal window, bidirectional
# windows beside global layers, plain padding.
SLOW_FAMILIES = ("llama", "mistral", "modernbert", "bert")
ENCODERS = ("modernbert", "bert", "roberta", "distilbert", "albert", "electra")
BACKENDS = [pytest.param(None, id="automatic"), *backends_for("attention")]


def _dtype(backend):
    # float64 where the backend takes it: differences are then the kernels' own, not
    # rounding amplified through layers; Triton's kernels take GPU dtypes.
    return torch.float32 if backend in ("triton", "cuda") else torch.float64


def _pair(family, backend, tmp_path):
    """The same random weights as transformers' "sdpa" model and as the "fusedlm" one."""
    if backend == "cuda" and slow_backend(backend):
        pytest.skip("cuda on the emulator: its kernels take bfloat16 or float16 at head dims 64 "
                    "and 128, not these float32 models of head dim 16 (its grouped and windowed "
                    "paths are tested op by op in test_attention_cuda_windows.py)")
    if backend is not None and slow_backend(backend) and family not in SLOW_FAMILIES:
        pytest.skip(f"{backend} here runs the families {', '.join(SLOW_FAMILIES)}")
    torch.manual_seed(0)
    config = _config(family)
    auto = transformers.AutoModelForCausalLM if family in CAUSAL else transformers.AutoModelForMaskedLM
    auto.from_config(config).save_pretrained(tmp_path)
    device = backend_device(backend) if backend else torch.device("cpu")
    return tuple(auto.from_pretrained(tmp_path, attn_implementation=name,
                                      dtype=_dtype(backend)).to(device)
                 for name in ("sdpa", hf_attention.NAME))


def _batch(family, device, left=False):
    """Token ids and their padding mask, lengths LENGTHS, padded on the right (on the left
    for generation)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (len(LENGTHS), SEQ), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        if left:
            mask[row, SEQ - length:] = 1
        else:
            mask[row, :length] = 1
    return ids.masked_fill(mask == 0, PAD).to(device), mask.to(device)


def _tolerance(backend):
    return 1e-4 if _dtype(backend) == torch.float32 else 1e-9


def _assert_close(actual, expected, backend, what):
    scale = expected.abs().max().clamp_min(1)
    error = ((actual - expected).abs().max() / scale).item()
    assert error < _tolerance(backend), f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CAUSAL + ENCODERS)
def test_outputs_at_real_tokens_match_sdpa(family, backend, tmp_path):
    sdpa, fused = _pair(family, backend, tmp_path)
    ids, mask = _batch(family, next(fused.parameters()).device)
    with torch.no_grad(), fusedlm.use_backend(backend):
        expected = sdpa(input_ids=ids, attention_mask=mask).logits
        actual = fused(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    _assert_close(actual[real], expected[real], backend, f"{family} logits")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CAUSAL + ENCODERS)
def test_training_loss_and_every_gradient_match_sdpa(family, backend, tmp_path):
    sdpa, fused = _pair(family, backend, tmp_path)
    ids, mask = _batch(family, next(fused.parameters()).device)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (sdpa, fused):
        model.train()
        with fusedlm.use_backend(backend):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                        if p.grad is not None}))
    (expected_loss, expected), (loss, grads) = results
    _assert_close(loss, expected_loss, backend, f"{family} loss")
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        _assert_close(grad, expected[name], backend, f"{family} gradient of {name}")


@pytest.mark.parametrize("mode", [{"num_beams": 1}, {"num_beams": 3, "num_return_sequences": 2}],
                         ids=["greedy", "beam"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", CAUSAL)
def test_generate_matches_sdpa(family, backend, mode, tmp_path):
    """Left-padded prompts, generated past the sliding window, with transformers' own cache
    (a sliding-window one for the sliding layers)."""
    sdpa, fused = _pair(family, backend, tmp_path)
    ids, mask = _batch(family, next(fused.parameters()).device, left=True)
    ids, mask = ids[:, -8:], mask[:, -8:]
    tokens = []
    for model in (sdpa, fused):
        with fusedlm.use_backend(backend):
            tokens.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2 * WINDOW,
                                         do_sample=False, pad_token_id=PAD, **mode))
    assert torch.equal(tokens[0], tokens[1])


def test_registered_at_import_without_importing_transformers():
    code = ("import sys, fusedlm; assert 'transformers' not in sys.modules; "
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS; "
            "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS; "
            "assert 'fusedlm' in ALL_ATTENTION_FUNCTIONS.valid_keys(); "
            "assert 'fusedlm' in ALL_MASK_ATTENTION_FUNCTIONS; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_registered_when_transformers_was_imported_first():
    code = ("import transformers.modeling_utils as mu, fusedlm; "
            "assert 'fusedlm' in mu.ALL_ATTENTION_FUNCTIONS.valid_keys(); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _qkv(heads=4, kv_heads=2, seq=10, dtype=torch.float64):
    torch.manual_seed(2)
    return (torch.randn(2, heads, seq, 16, dtype=dtype), torch.randn(2, kv_heads, seq, 16, dtype=dtype),
            torch.randn(2, kv_heads, seq, 16, dtype=dtype))


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def test_an_additive_float_mask_runs_as_a_bias_and_matches_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv()
    bias = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    expected, _ = sdpa_attention_forward(_Module(), q, k, v, bias)
    actual, _ = hf_attention.attention_forward(_Module(), q, k, v, bias)
    torch.testing.assert_close(actual, expected)


def test_softcapping_falls_back_with_one_warning_and_matches_the_formula():
    q, k, v = _qkv()
    hf_attention._WARNED.clear()
    with pytest.warns(UserWarning, match="softcap"):
        out, _ = hf_attention.attention_forward(_Module(), q, k, v, None, softcap=5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_attention.attention_forward(_Module(), q, k, v, None, softcap=5.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ kk.transpose(-1, -2) / 4 / 5.0) * 5.0
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    # (the softmax in float32, as transformers' eager attention)
    torch.testing.assert_close(out, (scores.softmax(-1) @ vv).transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_attention_sinks_and_head_masks_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sinks"):
        hf_attention.attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="head_mask"):
        hf_attention.attention_forward(_Module(), q, k, v, None, head_mask=torch.ones(4))
