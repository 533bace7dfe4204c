"""fusedlm.models' GPT-2 against transformers' GPT-2 of the same weights: outputs, losses
and gradients on left- and right-padded batches, every forward argument, checkpoints both
ways, generation through transformers' GenerationMixin over the fused KV cache, and each
deliberate difference."""
import copy
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import fusedlm
from fusedlm.models.gpt import CACHE, GPT2LMHeadModel, GPT2Model
from fusedlm.models.kv_cache import FusedKVCache
from models_helpers import assert_rel, perturb

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PAD, EOS = 100, 0, 1
LENGTHS = (9, 6, 2)
TINY = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)


def _config(**changes):
    return transformers.GPT2Config(**{**TINY, **changes}, attn_implementation="eager")


def _pair(cls=GPT2LMHeadModel, dtype=torch.float32, **changes):
    """(ours, theirs) of the same random weights, in eval mode. Generation compares in
    float64, where no two candidate tokens' scores are close enough for rounding to swap
    them."""
    theirs = getattr(transformers, cls.__name__)(_config(**changes)).to(dtype).eval()
    perturb(theirs, 0.3)
    ours = cls(_config(**changes)).to(dtype).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _padded(side: str, lengths=LENGTHS) -> dict:
    """Random ids padded (PAD) on ``side`` to the longest of ``lengths``, and the attention_mask."""
    seq = max(lengths)
    real = torch.arange(seq) < torch.tensor(lengths)[:, None]
    if side == "left":
        real = real.flip(1)
    ids = torch.randint(2, VOCAB, (len(lengths), seq)).masked_fill(~real, PAD)
    return {"input_ids": ids, "attention_mask": real.long()}


def _labels(batch: dict) -> torch.Tensor:
    """The ids as labels, ignored (-100) where the token or the one before it is padding: a
    prediction made at a padding position is not the model's (see
    test_outputs_at_padding_positions_are_the_fused_kernels)."""
    real = batch["attention_mask"].bool()
    seen = real & torch.cat([real[:, :1], real[:, :-1]], dim=1)
    return batch["input_ids"].masked_fill(~seen, -100)


def _with_backend(backend, run):
    fusedlm.set_backend(backend)
    try:
        return run()
    finally:
        fusedlm.set_backend(None)


def _enable_checkpointing(model, **options) -> None:
    """transformers' activation_checkpointing_enable (gradient_checkpointing_enable up to 5.17)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(**options)


def _float64_twin(theirs):
    """transformers' model in float64: the truth the float32 gradients are judged against."""
    return copy.deepcopy(theirs).double()


def _assert_same_grads(ours, theirs, truth, tol: float) -> None:
    """Every gradient of ours within ``tol`` (norm-wise) of transformers', or no further
    from the float64 ``truth`` than 4 times transformers' float32 one: a gradient whose
    terms cancel (c_attn's, through the softmax) loses more than ``tol`` to rounding on
    some draws, in both."""
    expected = dict(theirs.named_parameters())
    exact = dict(truth.named_parameters())
    assert {n for n, _ in ours.named_parameters()} == set(expected)
    # c_attn's key biases have zero gradients in exact arithmetic (softmax ignores a shift
    # of a row): rounding noise, small next to the largest gradient.
    floor = tol * max(p.grad.norm().item() for p in expected.values())
    for name, p in ours.named_parameters():
        got, want, true = (g.grad.detach().double() for g in (p, expected[name], exact[name]))
        error, ours_off, theirs_off = ((got - want).norm().item(), (got - true).norm().item(),
                                       (want - true).norm().item())
        close = error <= max(tol * want.norm().item(), floor)
        assert close or ours_off <= 4 * theirs_off + floor, (
            f"grad {name}: relative error {error / max(want.norm().item(), 1e-30):.2e} to "
            f"transformers'; {ours_off:.3g} from float64's, transformers' {theirs_off:.3g}")


# --- outputs, losses and gradients -------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_eval_outputs_match_transformers_at_real_tokens(side, backend):
    ours, theirs = _pair()
    batch = _padded(side)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = theirs(**batch, output_hidden_states=True, output_attentions=True)
        out = _with_backend(backend, lambda: ours(**batch, output_hidden_states=True))
        weights = ours(**batch, output_attentions=True).attentions
        body = _with_backend(backend, lambda: ours.transformer(**batch).last_hidden_state)
    assert_rel(out.logits[real], expected.logits[real], "logits")
    assert_rel(body[real], expected.hidden_states[-1][real], "GPT2Model's last_hidden_state")
    assert len(out.hidden_states) == len(expected.hidden_states) == TINY["n_layer"] + 1
    for i, (a, b) in enumerate(zip(out.hidden_states, expected.hidden_states)):
        assert_rel(a[real], b[real], f"hidden_states[{i}]")
    assert len(weights) == len(expected.attentions) == TINY["n_layer"]
    for i, (a, b) in enumerate(zip(weights, expected.attentions)):  # (B, nh, T, T): real queries
        assert_rel(a.transpose(1, 2)[real], b.transpose(1, 2)[real], f"attentions[{i}]")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_training_step_matches_transformers(side, backend):
    """Training mode, dropout 0: the loss and every gradient within 1e-5 of transformers',
    and after one AdamW step on each, the same loss again."""
    ours, theirs = _pair()
    truth = _float64_twin(theirs)
    batch = _padded(side)
    batch["labels"] = _labels(batch)
    losses = []
    for model in (ours.train(), theirs.train(), truth.train()):
        loss = _with_backend(backend, lambda: model(**batch).loss)
        loss.backward()
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()
        losses.append(loss)
    assert_rel(losses[0], losses[1], "loss", tol=1e-5)
    _assert_same_grads(ours, theirs, truth, tol=1e-5)
    with torch.no_grad():
        after = [_with_backend(backend, lambda: m(**batch).loss) for m in (ours, theirs)]
    assert_rel(after[0], after[1], "loss after the step", tol=1e-5)


@pytest.mark.parametrize("changes", [dict(scale_attn_by_inverse_layer_idx=True),
                                     dict(scale_attn_weights=False, n_inner=40),
                                     dict(activation_function="gelu_pytorch_tanh")],
                         ids=["inverse_layer_scale", "unscaled_n_inner", "gelu_pytorch_tanh"])
def test_other_supported_settings_match_transformers(changes):
    ours, theirs = _pair(**changes)
    batch = _padded("right")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        assert_rel(ours(**batch).logits[real], theirs(**batch).logits[real], "logits")


def _shifted_targets(batch: dict) -> torch.Tensor:
    """Random next-token targets (B, T), some ignored (-100): what a context-parallel trainer
    passes as shift_labels."""
    targets = torch.randint(0, VOCAB, batch["input_ids"].shape)
    return targets.masked_fill(torch.rand(targets.shape) < 0.3, -100)


LOSS_ARGUMENTS = {
    "num_items_in_batch_tensor": lambda batch: {"labels": _labels(batch), "num_items_in_batch": torch.tensor(29)},
    "num_items_in_batch_int": lambda batch: {"labels": _labels(batch), "num_items_in_batch": 29},
    "ignore_index": lambda batch: {"labels": _labels(batch).masked_fill(_labels(batch) == -100, -7),
                                   "ignore_index": -7},
    "shift_labels": lambda batch: {"labels": batch["input_ids"], "shift_labels": _shifted_targets(batch)},
    "shift_labels_num_items": lambda batch: {"labels": batch["input_ids"], "num_items_in_batch": 11,
                                             "shift_labels": _shifted_targets(batch)},
}


@pytest.mark.parametrize("head", ["fused", "module"])
@pytest.mark.parametrize("case", list(LOSS_ARGUMENTS))
def test_loss_arguments_give_transformers_loss_and_gradients(case, head):
    """transformers' causal LM loss arguments, through the fused loss (and through the head
    as a module, where a hook must see its product)."""
    ours, theirs = _pair()
    truth = _float64_twin(theirs)
    if head == "module":
        ours.lm_head.register_forward_hook(lambda module, args, out: None)
    batch = _padded("right")
    arguments = LOSS_ARGUMENTS[case](batch)
    losses = []
    for model in (ours.train(), theirs.train(), truth.train()):
        loss = model(**batch, **arguments).loss
        loss.backward()
        losses.append(loss)
    assert_rel(losses[0], losses[1], "loss", tol=1e-5)
    _assert_same_grads(ours, theirs, truth, tol=1e-5)


def test_the_trainer_passes_num_items_in_batch_as_to_transformers_models(tmp_path):
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    ours, theirs = (transformers.Trainer(model=m, args=args) for m in _pair())
    assert ours.model_accepts_loss_kwargs is theirs.model_accepts_loss_kwargs is True


@pytest.mark.parametrize("implementation", [None, "eager", "sdpa", "flash_attention_2"])
def test_every_attention_implementation_of_transformers_gpt2_runs_the_fused_path(implementation):
    """None, "eager", "sdpa" and "flash_attention_2" all give transformers' eager outputs
    and tokens (flash-attn need not be installed), and the attention weights when asked;
    the caller's config is left as it was."""
    _, theirs = _pair(dtype=torch.float64)
    config = transformers.GPT2Config(**TINY, attn_implementation=implementation)
    before = copy.deepcopy(vars(config))
    ours = GPT2LMHeadModel(config)
    assert vars(config) == before
    ours.load_state_dict(theirs.state_dict())
    ours = ours.to(torch.float64).eval()
    batch = _padded("left")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        out, expected = ours(**batch, output_attentions=True), theirs(**batch, output_attentions=True)
        assert_rel(ours(**batch).logits[real], expected.logits[real], "logits")
    for i, (a, b) in enumerate(zip(out.attentions, expected.attentions)):
        assert_rel(a.transpose(1, 2)[real], b.transpose(1, 2)[real], f"attentions[{i}]")
    found = [m.generate(**batch, max_new_tokens=6, do_sample=False) for m in (ours, theirs)]
    assert torch.equal(found[0], found[1])


# --- every forward argument ----------------------------------------------------------------------

def test_inputs_embeds_position_ids_and_token_type_ids_match_transformers():
    ours, theirs = _pair()
    ids = torch.randint(2, VOCAB, (2, 7))
    arguments = {"inputs_embeds": ours.transformer.wte(ids).detach(),
                 "position_ids": torch.randint(0, 64, (2, 7)),
                 "token_type_ids": torch.randint(0, VOCAB, (2, 7))}
    with torch.no_grad():
        for name, value in arguments.items():
            inputs = {name: value} if name == "inputs_embeds" else {"input_ids": ids, name: value}
            assert_rel(ours(**inputs).logits, theirs(**inputs).logits, f"logits with {name}")


def test_a_cache_continues_the_sequence_as_transformers_does():
    """Prompt then two steps: ours over its own FusedKVCache (the fused step) and over a
    transformers DynamicCache (the unfused path), passed as cache or as past_key_values,
    give transformers' logits."""
    ours, theirs = _pair()
    batch = _padded("left")
    steps = torch.randint(2, VOCAB, (3, 2))
    runs = {"fused": (ours, None), "dynamic": (ours, transformers.DynamicCache), "theirs": (theirs, None)}
    logits = {}
    with torch.no_grad():
        for name, (model, cache_class) in runs.items():
            cache = None if cache_class is None else cache_class()
            out = model(**batch, **{CACHE: cache}, use_cache=True)
            cache, mask, found = getattr(out, CACHE), batch["attention_mask"], [out.logits]
            for t in range(steps.shape[1]):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(steps[:, t:t + 1], past_key_values=cache, attention_mask=mask)
                cache = getattr(out, CACHE)
                found.append(out.logits)
            logits[name] = found
    assert isinstance(cache, transformers.cache_utils.Cache)
    real = batch["attention_mask"].bool()
    for name in ("fused", "dynamic"):
        assert_rel(logits[name][0][real], logits["theirs"][0][real], f"{name}: the prompt's logits")
        for t in (1, 2):
            assert_rel(logits[name][t], logits["theirs"][t], f"{name}: step {t}'s logits")


def test_return_dict_use_cache_logits_to_keep_and_config_defaults():
    ours, theirs = _pair()
    ids = torch.randint(2, VOCAB, (2, 6))
    with torch.no_grad():
        out = ours(ids)
        assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
        assert isinstance(getattr(out, CACHE), FusedKVCache)  # config.use_cache
        assert out["logits"] is out.logits is out[0]
        as_tuple = ours(ids, return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == len(theirs(ids, return_dict=False)) == 2
        torch.testing.assert_close(as_tuple[0], out.logits)
        assert getattr(ours(ids, use_cache=False), CACHE) is None
        assert_rel(ours(ids, logits_to_keep=2).logits, theirs(ids, logits_to_keep=2).logits, "kept logits")
        for model in (ours, theirs):
            model.config.update({"use_cache": False, "output_hidden_states": True})
        ours.config.return_dict = False  # (transformers' own GPT-2 fails with it)
        (ours_logits, ours_states), (their_logits, their_states) = ours(ids), theirs(ids, return_dict=False)
        assert len(ours_states) == len(their_states) == TINY["n_layer"] + 1
        assert_rel(ours_logits, their_logits, "logits under the config's defaults")
        if hasattr(transformers.utils.output_capturing, "selected_hidden_states"):  # after 5.17
            # output_hidden_states may name the states to keep; the others are None
            selected = ours.transformer(ids, output_hidden_states=[0, -1], return_dict=True)
            expected = theirs.transformer(ids, output_hidden_states=[0, -1], return_dict=True)
            assert ([s is None for s in selected.hidden_states]
                    == [s is None for s in expected.hidden_states] == [False, True, False])


# --- checkpoints ---------------------------------------------------------------------------------

CLASSES = {"ours": {"GPT2Model": GPT2Model, "GPT2LMHeadModel": GPT2LMHeadModel},
           "theirs": {"GPT2Model": transformers.GPT2Model, "GPT2LMHeadModel": transformers.GPT2LMHeadModel}}


@pytest.mark.parametrize("loaded", ["GPT2Model", "GPT2LMHeadModel"])
@pytest.mark.parametrize("saved", ["GPT2Model", "GPT2LMHeadModel"])
@pytest.mark.parametrize("writer", ["ours", "theirs"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_checkpoints_load_both_ways_as_transformers_loads_them(writer, saved, loaded, tied, tmp_path):
    """A folder either library writes loads into either library's class with the same
    weights and the same report of missing and unexpected keys."""
    model = CLASSES[writer][saved](_config(tie_word_embeddings=tied))
    perturb(model)
    model.save_pretrained(tmp_path)
    (ours, ours_info), (theirs, their_info) = (
        CLASSES[side][loaded].from_pretrained(tmp_path, output_loading_info=True)
        for side in ("ours", "theirs"))
    assert ours_info == their_info
    theirs_state = theirs.state_dict()
    assert ours.state_dict().keys() == theirs_state.keys()
    for name, tensor in ours.state_dict().items():
        if name not in ours_info["missing_keys"]:  # a missing untied head is drawn at random
            torch.testing.assert_close(tensor, theirs_state[name], rtol=0, atol=0, msg=name)
    if loaded == "GPT2LMHeadModel":
        assert (ours.lm_head.weight is ours.transformer.wte.weight) == tied


def test_sharded_folders_and_dtype_load_both_ways(tmp_path):
    ours, theirs = _pair()
    ours.save_pretrained(tmp_path / "ours", max_shard_size="60KB")
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    theirs.save_pretrained(tmp_path / "theirs", max_shard_size="60KB")
    low = GPT2LMHeadModel.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16).eval()
    assert {p.dtype for p in low.parameters()} == {p.dtype for p in again.parameters()} == {torch.bfloat16}
    for name, tensor in low.state_dict().items():
        torch.testing.assert_close(tensor, again.state_dict()[name], rtol=0, atol=0, msg=name)
    ids = torch.randint(2, VOCAB, (2, 8))
    with torch.no_grad():
        truth = ours(ids).logits
        # Rounding to bfloat16 alone moves the logits by 1-2%: fusedlm's bfloat16 model is
        # held to transformers' own on the same weights.
        theirs_error = ((again(ids).logits.float() - truth).norm() / truth.norm()).item()
        assert_rel(low(ids).logits.float(), truth, "bfloat16 logits", tol=2 * theirs_error + 1e-3)


def test_missing_unexpected_and_old_mask_buffers_are_reported_as_transformers_does(tmp_path):
    ours, _ = _pair()
    ours.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["transformer.h.1.ln_2.bias"]
    weights["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # older files' causal masks
    weights["transformer.h.1.attn.masked_bias"] = torch.tensor(-1e4)
    weights["transformer.h.0.mlp.extra"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, ours_info = GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    _, their_info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert ours_info == their_info
    assert ours_info["missing_keys"] == {"transformer.h.1.ln_2.bias"}
    assert "transformer.h.0.mlp.extra" in ours_info["unexpected_keys"]


# --- generation ----------------------------------------------------------------------------------

MODES = {"greedy": dict(do_sample=False),
         "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
         "sample": dict(do_sample=True)}  # top_k=50 etc.: the generation config's defaults


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_gives_transformers_tokens_on_a_left_padded_batch(mode):
    ours, theirs = _pair(dtype=torch.float64)
    batch = _padded("left", (7, 4, 2))
    found = []
    for model in (ours, theirs):
        torch.manual_seed(0)
        found.append(model.generate(**batch, max_new_tokens=8, **MODES[mode]))
    assert torch.equal(found[0], found[1])


def test_generate_decodes_through_attention_with_kvcache(monkeypatch):
    ours, _ = _pair()
    ours.generation_config.eos_token_id = None  # every step runs
    calls = []
    fused_step = fusedlm.ops.attention_with_kvcache
    monkeypatch.setattr(fusedlm.ops, "attention_with_kvcache",
                        lambda *a, **k: calls.append(a[0].shape) or fused_step(*a, **k))
    out = ours.generate(**_padded("left"), max_new_tokens=5, return_dict_in_generate=True)
    cache = getattr(out, CACHE)
    assert isinstance(cache, FusedKVCache) and cache.get_seq_length() == 9 + 4
    # One call per layer per forward: the prompt (9 queries), then one token at a time.
    assert calls == [(3, 9, 4, 16)] * 2 + [(3, 1, 4, 16)] * 8
    capacity = {layer.key_buffer.shape[1] for layer in cache.layers}
    assert capacity == {9 + 5 - 1}, "sized for the whole output up front, never grown"


def test_generate_with_other_caches_and_without_one_gives_the_same_tokens():
    ours, theirs = _pair(dtype=torch.float64)
    batch = _padded("left", (7, 4, 2))
    expected = theirs.generate(**batch, max_new_tokens=6, do_sample=False)
    for options in ({CACHE: transformers.DynamicCache()}, {"use_cache": False},
                    {"cache_implementation": "static"}):
        assert torch.equal(ours.generate(**batch, max_new_tokens=6, do_sample=False, **options),
                           expected), options


def test_generate_from_inputs_embeds_gives_transformers_tokens():
    ours, theirs = _pair(dtype=torch.float64)
    batch = _padded("left", (7, 4, 2))
    embeds = theirs.transformer.wte(batch["input_ids"]).detach()
    # min_new_tokens: every row runs all 6 steps (random weights may emit EOS early).
    found = [m.generate(inputs_embeds=embeds, attention_mask=batch["attention_mask"], max_new_tokens=6,
                        min_new_tokens=6, do_sample=False) for m in (ours, theirs)]
    assert torch.equal(found[0], found[1]) and found[0].shape == (3, 6)


class Recorder(transformers.generation.streamers.BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value.tolist())

    def end(self):
        self.ended = True


class StopAtLength(transformers.StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_a_streamer_receives_the_tokens_and_a_stopping_criterion_stops():
    ours, theirs = _pair(dtype=torch.float64)
    prompt = torch.randint(2, VOCAB, (1, 5))
    stop = transformers.StoppingCriteriaList([StopAtLength(5 + 4)])
    found = []
    for model in (ours, theirs):
        streamer = Recorder()
        out = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                             streamer=streamer, stopping_criteria=stop)
        found.append((out, streamer.tokens))
        assert out.shape == (1, 9) and streamer.ended
        assert streamer.tokens[0] == prompt.tolist() and sum(streamer.tokens[1:], []) == out[0, 5:].tolist()
    assert torch.equal(found[0][0], found[1][0]) and found[0][1] == found[1][1]


def test_the_text_generation_pipeline_gives_transformers_text():
    tokenizers = pytest.importorskip("tokenizers")
    words = "the a film plot was is great dull moving actors who went to paris and london".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + words)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                                     eos_token="<eos>", unk_token="<unk>")
    ours, theirs = _pair(vocab_size=len(vocab))
    prompts = ["the film was", "actors who went to"]
    texts = [transformers.pipeline("text-generation", model=m, tokenizer=tokenizer, device="cpu")(
        prompts, max_new_tokens=6, do_sample=False) for m in (ours, theirs)]
    assert texts[0] == texts[1]
    assert texts[0][0][0]["generated_text"].startswith("the film was")


def test_the_cache_grows_crops_and_selects_rows():
    """Decoding token by token from an empty FusedKVCache (which doubles as it fills) gives
    the logits of one forward over the whole sequence; after crop, batch_select_indices or
    batch_repeat_interleave the next step still does."""
    ours, _ = _pair()
    ids = torch.randint(2, VOCAB, (3, 12))
    with torch.no_grad():
        full = ours(ids, use_cache=False).logits
        cache = FusedKVCache(ours.config)
        steps = [ours(ids[:, t:t + 1], cache).logits for t in range(10)]
        assert_rel(torch.cat(steps, dim=1), full[:, :10], "step by step")
        assert {layer.key_buffer.shape[1] for layer in cache.layers} == {16}  # 1, 2, 4, 8, 16
        cache.crop(-3)
        assert_rel(ours(ids[:, 7:11], cache).logits, full[:, 7:11], "after crop")
        cache.batch_select_indices(torch.tensor([2, 0]))
        assert_rel(ours(ids[[2, 0], 11:12], cache).logits, full[[2, 0], 11:12], "selected rows")
        cache.crop(-1)
        cache.batch_repeat_interleave(2)
        assert_rel(ours(ids[[2, 2, 0, 0], 11:12], cache).logits, full[[2, 2, 0, 0], 11:12], "repeated rows")


def _prompt_caches(model, batch: dict) -> list:
    """[a FusedKVCache, a DynamicCache], each holding batch's prompt as model's forward
    leaves it (the fused step, and the unfused path)."""
    with torch.no_grad():
        return [getattr(model(**batch, **{CACHE: cache}, use_cache=True), CACHE)
                for cache in (FusedKVCache(model.config), transformers.DynamicCache())]


def _assert_same_cache(fused, dynamic, real: torch.Tensor) -> None:
    """fused and dynamic hold the same tokens, in transformers' layout: keys and values
    (B, nh, S, hs) equal where real (bool (B, S), False at padding, which the fused and the
    unfused path compute differently)."""
    assert fused.get_seq_length() == dynamic.get_seq_length()
    assert len(fused) == len(dynamic) and fused.is_initialized == dynamic.is_initialized
    assert fused.get_mask_sizes(3, 1) == dynamic.get_mask_sizes(3, 1)
    for i, (ours, theirs) in enumerate(zip(fused, dynamic)):  # (keys, values, sliding window)
        assert ours[2] is theirs[2] is None
        for name, a, b in zip(("keys", "values"), ours, theirs):
            assert torch.equal(getattr(fused.layers[i], name), a) and a.shape == b.shape
            shown = real[:, None, :a.shape[2], None].expand_as(a)
            assert_rel(a[shown], b[shown], f"layer {i} {name}")


@pytest.mark.parametrize("count", [-3, 0, -20, 4, 20])
def test_crop_removes_what_dynamic_cache_removes(count):
    """crop(n <= 0) removes -n tokens (crop(0) none); a positive n is the length kept where
    transformers reads it so (up to 5.17) and refused where it refuses it. The next step
    then gives what it gives over the DynamicCache."""
    ours, _ = _pair()
    batch = _padded("left")
    caches = _prompt_caches(ours, batch)
    outcomes = []
    for cache in caches:
        try:
            cache.crop(count)
            outcomes.append(cache.get_seq_length())
        except ValueError:
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1]
    if outcomes[0] == "refused":
        return
    real = batch["attention_mask"].bool()
    _assert_same_cache(*caches, real)
    kept = outcomes[0]
    mask = torch.cat([batch["attention_mask"][:, :kept], torch.ones(3, 2, dtype=torch.long)], dim=1)
    with torch.no_grad():
        steps = [ours(batch["input_ids"][:, :2], cache, attention_mask=mask).logits for cache in caches]
    assert_rel(steps[0], steps[1], "the step after crop")


def test_the_cache_is_what_a_dynamic_cache_is_to_code_that_reads_it():
    """transformers' contract, read against a DynamicCache filled by the same model: keys and
    values (B, nh, S, hs) through layers[i] and iteration, after decoding steps and through
    beam search's reorder_cache, batch_select_indices, batch_repeat_interleave, offload and
    prefetch; DynamicCache(fused) copies it; reset empties it."""
    ours, _ = _pair()
    batch = _padded("left")
    caches = _prompt_caches(ours, batch)
    real, mask = batch["attention_mask"].bool(), batch["attention_mask"]
    steps = torch.randint(2, VOCAB, (3, 2))
    with torch.no_grad():
        for t in range(2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            for cache in caches:
                ours(steps[:, t:t + 1], cache, attention_mask=mask)
    real = torch.cat([real, torch.ones(3, 2, dtype=torch.bool)], dim=1)
    _assert_same_cache(*caches, real)
    _assert_same_cache(transformers.DynamicCache(caches[0]), caches[1], real)
    changes = [("reorder_cache", torch.tensor([2, 0, 0]), [2, 0, 0]),
               ("batch_select_indices", torch.tensor([1, 0]), [1, 0]),
               ("batch_repeat_interleave", 2, [0, 0, 1, 1])]
    for method, argument, rows in changes:
        for cache in caches:
            getattr(cache, method)(argument)
        real = real[rows]
        _assert_same_cache(*caches, real)
    for layer in caches[0].layers:
        layer.offload()
        layer.prefetch()
    _assert_same_cache(*caches, real)
    # reset empties the cache as DynamicCache's does since transformers 5.18 (5.17's zeroed
    # the tensors and kept their length).
    caches[0].reset()
    assert (caches[0].get_seq_length(), caches[0].is_initialized, caches[0].layers[0].keys) == (0, False, None)


def _left_padded_row(length: int, padding: int) -> dict:
    ids = torch.randint(2, VOCAB, (1, length))
    mask = torch.ones_like(ids)
    ids[:, :padding], mask[:, :padding] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def _assistant(model, kind: str):
    """A copy of model (its candidates all taken: the main model's cache is cropped by 0)
    or a smaller model of other weights (most of its candidates refused)."""
    assistant = GPT2LMHeadModel(_config(n_layer=TINY["n_layer"] if kind == "copy" else 1))
    if kind == "copy":
        assistant.load_state_dict(model.state_dict())
    else:
        perturb(assistant, 0.3)
    return assistant.to(torch.float64).eval()


@pytest.mark.parametrize("padding", [0, 3], ids=["one_sequence", "left_padded"])
@pytest.mark.parametrize("method", ["assistant_copy", "assistant_other", "prompt_lookup"])
def test_assisted_and_prompt_lookup_decoding_give_the_greedy_tokens(method, padding):
    """Both crop the caches after every round (crop(0) where every candidate was taken, or
    none proposed): the tokens are greedy decoding's, ours and transformers'."""
    ours, theirs = _pair(dtype=torch.float64)
    batch = _left_padded_row(12, padding)
    options = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    if method == "prompt_lookup":
        assisted = dict(prompt_lookup_num_tokens=2)
    else:
        assisted = dict(assistant_model=_assistant(ours, method.removeprefix("assistant_")))
    greedy = theirs.generate(**batch, **options)
    assert torch.equal(ours.generate(**batch, **options), greedy)
    assert torch.equal(ours.generate(**batch, **options, **assisted), greedy)


# --- the deliberate differences, training features and refusals ---------------------------------

def test_training_with_labels_builds_no_logits_unless_asked():
    ours, _ = _pair()
    ids = torch.randint(2, VOCAB, (2, 7))
    ours.train()
    out = ours(ids, labels=ids)
    assert out.logits is None and out.loss is not None  # the fused loss never built them
    assert ours(ids, labels=ids, return_logits=True).logits.shape == (2, 7, VOCAB)
    assert ours(ids).logits.shape == (2, 7, VOCAB)  # no labels
    ours.eval()
    assert ours(ids, labels=ids).logits.shape == (2, 7, VOCAB)


def test_outputs_at_padding_positions_are_the_fused_kernels():
    """A left-padding position sees only padding: the fused attention gives it a row of
    zeros where transformers averages the padding. output_attentions=True, the plain path,
    computes transformers' values there too."""
    ours, theirs = _pair()
    batch = _padded("left")
    padding = batch["attention_mask"] == 0
    with torch.no_grad():
        fused, plain, expected = (ours(**batch).logits, ours(**batch, output_attentions=True).logits,
                                  theirs(**batch).logits)
    assert not torch.allclose(fused[padding], expected[padding], atol=1e-3)
    assert_rel(plain[padding], expected[padding], "plain path at padding")
    assert_rel(fused[~padding], expected[~padding], "fused path at real tokens")


def _enable_checkpointing_with(model, options: dict) -> None:
    """gradient_checkpointing_enable(**options), as the caller writes it (transformers' name
    before 5.18, its deprecated alias since)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(**options)


def _count_block_runs(model) -> list:
    """A list that gets one entry each time a block's MLP starts: a recomputation runs it
    again (up to the last tensor the backward needs, so a hook at its end may not see it)."""
    runs = []
    for block in model.transformer.h:
        block.mlp.register_forward_pre_hook(lambda module, args: runs.append(1))
    return runs


CHECKPOINTING = {"reentrant": dict(gradient_checkpointing_kwargs={"use_reentrant": True}),
                 "non_reentrant": dict(gradient_checkpointing_kwargs={"use_reentrant": False}),
                 "every_2nd_layer": dict(every_n_layers=2)}


@pytest.mark.parametrize("options", list(CHECKPOINTING))
def test_gradient_checkpointing_options_give_transformers_gradients(options):
    """gradient_checkpointing_enable's arguments as transformers' GPT-2 takes them: each
    block (every n-th) runs again in the backward, through torch's checkpoint with the
    caller's arguments, and the gradients are transformers'."""
    ours, theirs = _pair()
    truth = _float64_twin(theirs)
    batch = _padded("right")
    batch["labels"] = _labels(batch)
    runs = _count_block_runs(ours)
    losses = []
    for model in (ours.train(), theirs.train(), truth.train()):
        _enable_checkpointing_with(model, CHECKPOINTING[options])
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    checkpointed = 1 if options == "every_2nd_layer" else TINY["n_layer"]
    assert len(runs) == TINY["n_layer"] + checkpointed
    assert_rel(losses[0], losses[1], "loss", tol=1e-5)
    _assert_same_grads(ours, theirs, truth, tol=1e-5)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients_with_dropout(reentrant):
    config = _config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    ids = torch.randint(2, VOCAB, (2, 11))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).train()
        if checkpointed:
            _enable_checkpointing_with(model, dict(gradient_checkpointing_kwargs={"use_reentrant": reentrant}))
            assert model.transformer.gradient_checkpointing
        torch.manual_seed(1)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append([loss] + [p.grad for p in model.parameters()])
    assert grads[0][0] != model.eval()(ids, labels=ids).loss  # dropout did act
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_autocast_bfloat16_trains_close_to_float32():
    ours, _ = _pair()
    ours.train()
    ids = torch.randint(2, VOCAB, (2, 13))
    full = ours(ids, labels=ids, return_logits=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ours(ids, labels=ids, return_logits=True)
    assert low.logits.dtype == torch.bfloat16
    assert abs(low.loss.item() - full.loss.item()) < 3e-2 * full.loss.item()
    low.loss.backward()
    assert all(p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in ours.parameters())


def test_peft_lora_on_every_conv1d_gives_transformers_outputs():
    """LoRA also wraps the MLP's Conv1D layers, which the fused MLP reads: they then run as
    modules, so the adapters' deltas are never skipped."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                           lora_dropout=0.0, fan_in_fan_out=True, task_type="CAUSAL_LM")
    wrapped = [peft.get_peft_model(m, lora) for m in _pair()]
    adapters = {n: torch.randn_like(p) * 0.1 for n, p in wrapped[1].named_parameters() if "lora_" in n}
    for model in wrapped:
        model.load_state_dict(adapters, strict=False)
    batch = _padded("right")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        a, b = (m(**batch).logits for m in wrapped)
        with wrapped[0].disable_adapter():
            plain = wrapped[0](**batch).logits
    assert_rel(a[real], b[real], "LoRA logits")
    assert not torch.allclose(plain, a), "the adapters changed nothing"


@pytest.mark.parametrize("changes, name", [
    (dict(add_cross_attention=True), "add_cross_attention"),
    (dict(activation_function="relu"), "activation_function"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    (dict(n_embd=62), "n_embd"),
])
def test_settings_the_fused_path_cannot_honour_are_refused_by_name(changes, name):
    for cls in (GPT2Model, GPT2LMHeadModel):
        with pytest.raises(ValueError, match=name):
            cls(_config(**changes))


def test_bad_calls_name_the_argument():
    ours, _ = _pair()
    ids = torch.randint(2, VOCAB, (2, 5))
    bad = [(dict(attention_mask=torch.ones(2, 1, 5, 5)), "attention_mask"),
           (dict(attention_mask=torch.ones(2, 4)), "attention_mask"),
           (dict(labels=ids[:, 1:]), "labels"),
           (dict(encoder_hidden_states=torch.randn(2, 3, 64)), "encoder_hidden_states"),
           (dict(inputs_embeds=torch.randn(2, 5, 64)), "input_ids and inputs_embeds"),
           (dict(logits_to_keep=torch.ones(2, 5, dtype=torch.bool)), "logits_to_keep"),
           (dict(cache=FusedKVCache(ours.config), past_key_values=FusedKVCache(ours.config)),
            "past_key_values")]
    for options, name in bad:
        with pytest.raises(ValueError, match=name):
            ours(ids, **options)
    for options, name in [(dict(shift_labels=ids), "shift_labels needs labels"),
                           (dict(labels=ids, shift_labels=ids[:, 1:]), "shift_labels must be")]:
        with pytest.raises(ValueError, match=name):
            ours(ids, **options)
    _enable_checkpointing(ours)
    ours.train()
    with pytest.raises(ValueError, match="use_cache"):
        ours(ids, use_cache=True)
