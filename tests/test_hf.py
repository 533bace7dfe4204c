"""fusedlm.patch on Hugging Face models built from tiny configs: the patched model's loss,
logits and every parameter gradient match the unpatched model's on fresh inputs with
padding masks of mixed lengths; asked for them, it returns eager attention's weights; a
model sharing its config is left as it was."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedlm  # noqa: E402
from fusedlm.patching.hf_attention import NAME  # noqa: E402

VOCAB, SEQ, PAD = 100, 24, 1
LENGTHS = (SEQ, SEQ - 7, 5)  # mixed lengths, right-padded


def _config(family, dropout=0.0, **overrides):
    common = dict(vocab_size=VOCAB, pad_token_id=PAD)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=dropout,
                                       embd_pdrop=dropout, attn_pdrop=dropout, **common, **overrides)
    if family == "distilbert":
        return transformers.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                             max_position_embeddings=64, dropout=dropout,
                                             attention_dropout=dropout, **common, **overrides)
    cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig,
           "electra": transformers.ElectraConfig, "albert": transformers.AlbertConfig}[family]
    extra = {"embedding_size": 32} if family in ("electra", "albert") else {}
    return cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=64, hidden_dropout_prob=dropout,
               attention_probs_dropout_prob=dropout, **common, **extra, **overrides)


MODELS = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM",
          "electra": "ElectraForMaskedLM", "distilbert": "DistilBertForMaskedLM",
          "albert": "AlbertForMaskedLM", "gpt2": "GPT2LMHeadModel"}
# The layers a family's config builds: ALBERT's share one set of weights, one module.
LAYER_MODULES = {"albert": 1}


def _pair(family, dtype=torch.float32, **config):
    """(unpatched, patched) with the same weights, built from one config object (patching
    one leaves the other's attention as it is)."""
    cls = getattr(transformers, MODELS[family])
    shared = _config(family, **config)
    reference = cls(shared).to(dtype)
    patched = cls(shared).to(dtype)
    patched.load_state_dict(reference.state_dict())
    return reference, fusedlm.patch(patched)


def _batch(family):
    ids = torch.randint(PAD + 1, VOCAB, (len(LENGTHS), SEQ))
    mask = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, PAD)
    if family == "gpt2":
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = ids.masked_fill((torch.rand(ids.shape) > 0.3) | (mask == 0), -100)
        labels[0, 0] = ids[0, 0]  # at least one labelled token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


def _assert_close(actual, expected, rtol, name, floor=0.0):
    """max |actual - expected| <= rtol * max(max |expected|, floor)."""
    scale = max(expected.abs().max().item(), floor)
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


def _assert_grads_match(patched, reference, rtol):
    expected, actual = _grads(reference), _grads(patched)
    assert actual.keys() == expected.keys()
    # A key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a shift
    # shared by a query's scores): what the float32 runs give is rounding noise, so errors
    # are measured against at least a millionth of the model's largest gradient.
    floor = 1e-6 * max(g.abs().max().item() for g in expected.values() if g is not None)
    for name, grad in expected.items():
        assert (actual[name] is None) == (grad is None), name
        if grad is not None:
            _assert_close(actual[name], grad, rtol, name, floor)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float64, 1e-9)],
                         ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", list(MODELS))
def test_patched_model_matches_unpatched(family, dtype, rtol):
    if family == "gpt2" and dtype == torch.float64:
        rtol = 1e-6  # transformers' causal-LM loss runs on logits.float(): float32 rounding
    reference, patched = _pair(family, dtype)
    batch = _batch(family)
    reference.train()
    patched.train()
    out_ref, out = reference(**batch), patched(**batch)
    assert out.logits is None  # training with labels: the fused head never builds them
    _assert_close(out.loss, out_ref.loss, rtol, "loss")
    out_ref.loss.backward()
    out.loss.backward()
    _assert_grads_match(patched, reference, rtol)

    reference.eval()
    patched.eval()
    with torch.no_grad():
        out_ref, out = reference(**batch), patched(**batch)
    _assert_close(out.loss, out_ref.loss, rtol, "eval loss")
    _assert_close(out.logits, out_ref.logits, rtol, "eval logits")


@pytest.mark.parametrize("family", list(MODELS))
def test_report_names_every_fused_block_and_patching_twice_changes_nothing(family):
    reference, patched = _pair(family)
    report = fusedlm.patch_report(patched)
    rules = list(report.replaced.values())
    assert report.replaced[""].startswith(MODELS[family])
    layers = LAYER_MODULES.get(family, 2)
    assert sum("attention" in r for r in rules) == layers  # one per layer module
    assert sum("GELU" in r for r in rules) == layers
    assert type(patched) is type(reference)
    assert patched.config._attn_implementation == NAME != reference.config._attn_implementation
    before = dict(report.replaced)
    fusedlm.patch(patched)
    assert fusedlm.patch_report(patched).replaced == before


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_state_dict_round_trip_and_inference_modes(family):
    reference, patched = _pair(family)
    assert patched.state_dict().keys() == reference.state_dict().keys()
    fresh = type(reference)(_config(family))
    fresh.load_state_dict(patched.state_dict())
    batch = _batch(family)
    fresh.eval()
    patched.eval()
    with torch.no_grad():
        expected = fresh(**batch)
    with torch.inference_mode():
        out = patched(**batch)
    _assert_close(out.logits, expected.logits, 1e-4, "logits")
    _assert_close(out.loss, expected.loss, 1e-4, "loss")
    without_labels = patched(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert without_labels.loss is None
    _assert_close(without_labels.logits, expected.logits, 1e-4, "logits without labels")


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_dropout_is_active_in_training_only(family):
    _, patched = _pair(family, dropout=0.1)
    batch = _batch(family)
    patched.train()
    assert patched(**batch).loss.item() != patched(**batch).loss.item()
    patched.eval()
    with torch.no_grad():
        assert torch.equal(patched(**batch).logits, patched(**batch).logits)


@pytest.mark.parametrize("family", list(MODELS))
def test_bf16_autocast_loss(family):
    reference, patched = _pair(family)
    batch = _batch(family)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, loss = reference(**batch).loss, patched(**batch).loss
    _assert_close(loss, expected, 1e-2, "bf16 loss")
    loss.backward()
    assert all(p.grad is not None for p in patched.parameters() if p.requires_grad)


def test_compiled_patched_bert_has_no_graph_breaks():
    reference, patched = _pair("bert")
    batch = _batch("bert")
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    loss = compiled(**batch).loss
    _assert_close(loss, reference(**batch).loss, 1e-4, "compiled loss")
    loss.backward()
    reference(**batch).loss.backward()
    _assert_grads_match(patched, reference, 1e-4)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_patching_leaves_models_sharing_the_config_alone(family):
    cls = getattr(transformers, MODELS[family])
    config = _config(family)
    model, other = cls(config).eval(), cls(config).eval()
    other.load_state_dict(model.state_dict())
    batch = _batch(family)
    with torch.no_grad():
        before = other(**batch)
    implementation = config._attn_implementation
    fusedlm.patch(model)
    assert config._attn_implementation == implementation != NAME
    assert other.config is config and all(
        m.config is config for m in other.modules() if hasattr(m, "config"))
    assert model.config is not config and model.config._attn_implementation == NAME
    assert all(m.config is model.config for m in model.modules() if hasattr(m, "config"))
    with torch.no_grad():
        after, patched = other(**batch), model(**batch)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)
    _assert_close(patched.logits, before.logits, 1e-4, "patched logits")


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_output_attentions_returns_the_eager_weights(family):
    """Asked for the weights, a patched model computes them as transformers' eager
    attention does (which the unpatched model needs to return them)."""
    cls = getattr(transformers, MODELS[family])
    eager = cls(_config(family, attn_implementation="eager")).eval()
    patched = fusedlm.patch(cls(_config(family)).eval())
    patched.load_state_dict(eager.state_dict())
    batch = _batch(family)
    with torch.no_grad():
        expected = eager(**batch, output_attentions=True)
        out = patched(**batch, output_attentions=True)
        without = patched(**batch)
    assert len(out.attentions) == len(expected.attentions) == 2
    for layer, (weights, ref) in enumerate(zip(out.attentions, expected.attentions)):
        assert weights.shape == (len(LENGTHS), 4, SEQ, SEQ)
        _assert_close(weights, ref, 1e-5, f"attentions[{layer}]")
    _assert_close(out.logits, expected.logits, 1e-4, "logits")
    _assert_close(out.loss, expected.loss, 1e-4, "loss")
    _assert_close(without.logits, out.logits, 1e-4, "logits without the weights")
    assert not without.attentions


def test_unsupported_configs_are_left_alone_with_a_reason():
    model = fusedlm.patch(transformers.BertForMaskedLM(_config("bert", hidden_act="relu")))
    left = fusedlm.patch_report(model).left_alone
    assert "not a GELU" in left["bert.encoder.layer.0.intermediate"]
    gpt2 = fusedlm.patch(transformers.GPT2LMHeadModel(_config("gpt2", add_cross_attention=True)))
    left = fusedlm.patch_report(gpt2).left_alone
    assert "cross-attention" in left["transformer.h.0.attn"]
    assert gpt2.config._attn_implementation != NAME


def test_gpt2_generation_with_cache_and_left_padding_matches():
    reference, patched = _pair("gpt2")
    reference.eval()
    patched.eval()
    ids = torch.randint(PAD + 1, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the cache steps get SDPA's full masks, not compact ones
    ids = ids.masked_fill(mask == 0, PAD)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    expected = reference.generate(ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    out = patched.generate(ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for step, (score, ref_score) in enumerate(zip(out.scores, expected.scores)):
        _assert_close(score, ref_score, 1e-4, f"scores of step {step}")


def test_gradient_checkpointing_works_on_fused_distilbert_blocks():
    # The fused block replaces a transformers GradientCheckpointingLayer: checkpointing
    # switched on before or after patching recomputes it, with the same gradients.
    reference, patched = _pair("distilbert")
    for model in (reference, patched):  # transformers 5.x renamed it
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    batch = _batch("distilbert")
    reference.train()
    patched.train()
    reference(**batch).loss.backward()
    patched(**batch).loss.backward()
    assert all(layer.gradient_checkpointing for layer in patched.distilbert.transformer.layer)
    _assert_grads_match(patched, reference, 1e-4)
