"""What the model tests share: a tiny corpus, padded batches, a training loop, and
comparisons with transformers' models of the same weights."""
import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import fusedlm
from fusedlm.models import mask_tokens

PAD, CLS, SEP, MASK, UNK = range(5)
SPECIALS = (PAD, CLS, SEP, MASK, UNK)
RELATIVE_ERROR = 1e-5  # float32 against float32, norm-wise
VOCAB = 40  # the tiny configurations' vocabulary
LENGTHS = (12, 9, 5)  # padding in two rows of the parity batch: the packed path runs


class Corpus:
    """The first ``count`` sentences of a few standard-library docstrings, as ids of a
    vocabulary of their most frequent words (the rest are UNK). Built here, nothing
    downloaded; few enough sentences that a tiny model learns them in a few hundred steps."""

    def __init__(self, count: int = 16, words: int = 60, min_len: int = 3, max_len: int = 12):
        text = " ".join(f.__doc__ for f in (str.split, str.join, str.replace, list.sort, dict.get,
                                             dict.update, sorted, zip, enumerate, range, open))
        sentences = [re.findall(r"[a-z]+", s.lower()) for s in re.split(r"[.:;\n]\s", text)]
        counts = {}
        for sentence in sentences:
            for w in sentence:
                counts[w] = counts.get(w, 0) + 1
        vocab = sorted(counts, key=lambda w: (-counts[w], w))[:words]
        self.ids = {w: i + len(SPECIALS) for i, w in enumerate(vocab)}
        self.vocab_size = len(SPECIALS) + len(vocab)
        self.sentences = [[self.ids.get(w, UNK) for w in s][:max_len] for s in sentences
                          if len(s) >= min_len][:count]

    def pick(self, size: int, generator: torch.Generator) -> list:
        return torch.randint(len(self.sentences), (size,), generator=generator).tolist()

    def batch(self, size: int, generator: torch.Generator, pairs: bool = False) -> dict:
        """[CLS] A [SEP] (B [SEP]) rows padded on the right: input_ids, attention_mask,
        token_type_ids, and with pairs next_sentence_label (1 = B is a random sentence)."""
        rows, types, nsp = [], [], []
        for i in self.pick(size, generator):
            a = [CLS] + self.sentences[i] + [SEP]
            if not pairs:
                rows.append(a)
                types.append([0] * len(a))
                continue
            random_b = bool(torch.rand((), generator=generator) < 0.5)
            j = self.pick(1, generator)[0] if random_b else (i + 1) % len(self.sentences)
            b = self.sentences[j] + [SEP]
            rows.append(a + b)
            types.append([0] * len(a) + [1] * len(b))
            nsp.append(int(random_b and j != (i + 1) % len(self.sentences)))
        return _pad(rows, types, nsp if pairs else None)


def _pad(rows, types, nsp) -> dict:
    seq = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), seq), PAD)
    token_type_ids = torch.zeros((len(rows), seq), dtype=torch.long)
    for b, (r, t) in enumerate(zip(rows, types)):
        input_ids[b, :len(r)] = torch.tensor(r)
        token_type_ids[b, :len(t)] = torch.tensor(t)
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(),
             "token_type_ids": token_type_ids}
    if nsp is not None:
        batch["next_sentence_label"] = torch.tensor(nsp)
    return batch


def parity_batch(vocab_size: int, lengths: tuple) -> dict:
    """Random ids padded to the longest of ``lengths``, with labels for every head:
    ``labels`` (masked LM), next_sentence_label, class_labels, tag_labels, QA spans, and
    a sequence classifier's regression_labels (one label) and multi_labels (three)."""
    batch, seq = len(lengths), max(lengths)
    mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(len(SPECIALS), vocab_size, (batch, seq)).masked_fill(mask == 0, PAD)
    types = (torch.arange(seq) >= 4).long().expand(batch, seq) * mask
    labels = torch.where((torch.rand(batch, seq) < 0.4) & (mask == 1), ids, -100)
    labels[0, 1] = ids[0, 1]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels,
            "next_sentence_label": torch.randint(2, (batch,)),
            "class_labels": torch.randint(3, (batch,)),
            "tag_labels": torch.randint(3, (batch, seq)).masked_fill(mask == 0, -100),
            # one start lies past the sequence: clamped to seq and ignored
            "start_positions": torch.tensor([3, 2, seq + 4][:batch]),
            "end_positions": torch.tensor([7, 8, 4][:batch]),
            "regression_labels": torch.randn(batch),
            "multi_labels": torch.randint(2, (batch, 3)).float()}


def masked(batch: dict, vocab_size: int, generator: torch.Generator) -> dict:
    ids, labels = mask_tokens(batch["input_ids"], mask_token_id=MASK, vocab_size=vocab_size,
                              special_token_ids=SPECIALS, attention_mask=batch["attention_mask"],
                              generator=generator)
    return {**batch, "input_ids": ids, "labels": labels}



def train(model, make_batch, steps: int, backend=None, lr: float = 3e-3, seed: int = 0) -> list:
    """Per-step losses of AdamW on batches make_batch(generator) draws, with every op on
    ``backend`` (None: chosen per call)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    fusedlm.set_backend(backend)
    try:
        for _ in range(steps):
            loss = model(**make_batch(generator)).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        fusedlm.set_backend(None)
    return losses


def assert_trains(model, make_batch, steps: int, compared: int = 20, **kwargs) -> None:
    """The loss falls below 0.8 x its first value within ``steps``, and the first
    ``compared`` steps on the cpu backend match those on the reference backend."""
    reference = train(copy.deepcopy(model), make_batch, compared, backend="reference", **kwargs)
    losses = train(model, make_batch, steps, backend="cpu", **kwargs)
    torch.testing.assert_close(torch.tensor(losses[:compared]), torch.tensor(reference),
                               rtol=2e-3, atol=1e-4)
    final = sum(losses[-10:]) / 10
    assert final < 0.8 * losses[0], f"loss {losses[0]:.3f} -> {final:.3f} after {steps} steps"


def assert_rel(actual, expected, name: str, tol: float = RELATIVE_ERROR, floor: float = 1e-7) -> None:
    """Norm-wise relative error at most tol; ``floor`` bounds the absolute error of values
    that are zero in exact arithmetic, where only rounding is left."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    diff = (actual - expected).norm().item()
    scale = expected.norm().item()
    assert diff <= tol * scale or diff <= floor, f"{name}: relative error {diff / max(scale, 1e-30):.2e}"


def perturb(model, scale: float = 0.1) -> None:
    """Random changes to every parameter, so that LayerNorm weights and biases (ones and
    zeros at init) tell apart whether each tensor reached its place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def assert_same_grads(ours, theirs) -> None:
    """Every parameter's gradient, by name (both models have transformers' names)."""
    expected = {n: p.grad for n, p in theirs.named_parameters()}
    actual = {n: p.grad for n, p in ours.named_parameters()}
    assert set(actual) == set(expected), (f"only ours: {sorted(set(actual) - set(expected))}, "
                                          f"only theirs: {sorted(set(expected) - set(actual))}")
    # The key biases' gradients are zero in exact arithmetic (softmax ignores a shift
    # along a row): rounding noise, small next to the largest gradient.
    floor = 1e-5 * max(g.norm().item() for g in expected.values() if g is not None)
    for name, grad in actual.items():
        if grad is None and expected[name] is None:
            continue
        assert grad is not None and expected[name] is not None, f"{name}: gradient missing on one side"
        assert_rel(grad, expected[name], f"grad {name}", floor=floor)


def call(model, batch: dict, **extra):
    """model(**batch) with the batch entries its forward names, and every ``extra``."""
    names = inspect.signature(model.forward).parameters
    return model(**{k: v for k, v in batch.items() if k in names}, **extra)


def qa_reference_loss(start, end, batch) -> torch.Tensor:
    """transformers' QA loss with padding excluded from the softmax, as fusedlm's QA heads do."""
    padding = batch["attention_mask"] == 0
    seq = start.shape[1]
    losses = []
    for logits, positions in ((start, batch["start_positions"]), (end, batch["end_positions"])):
        logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
        losses.append(F.cross_entropy(logits, positions.clamp(0, seq), ignore_index=seq))
    return (losses[0] + losses[1]) / 2


def _compare_outputs(ours, theirs, batch, per_token, per_sequence):
    real = batch["attention_mask"].bool()
    for field in per_token:
        assert_rel(getattr(ours, field)[real], getattr(theirs, field)[real], field)
    for field in per_sequence:
        assert_rel(getattr(ours, field), getattr(theirs, field), field)


def assert_matches_transformers(cls, hf_cls, hf_config, batch: dict, loss_of, per_token: tuple,
                                per_sequence: tuple, layers: int, tmp_path) -> None:
    """A transformers model (random weights, dropout off) saved by transformers loads
    into ``cls``; on a padded batch both give the same loss (``loss_of(output)``), the
    same gradient for every parameter, the same hidden states, and the same outputs
    (``per_token`` fields compared at real tokens, ``per_sequence`` whole); saved by
    fusedlm, it loads in transformers, which then gives the same outputs."""
    theirs = hf_cls(hf_config).eval()
    perturb(theirs)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = cls.from_pretrained(tmp_path / "theirs")

    expected = call(theirs, batch, output_hidden_states=True)
    loss_of(expected).backward()
    # Training mode with dropout 0: the masked-LM heads take their fused, labelled-rows path.
    ours.train()
    out = call(ours, batch, output_hidden_states=True)
    loss = loss_of(out)
    # A loss is a difference of log-sum-exps and logits: its error is absolute, the logits'
    # relative error times their size (a row's loss moves by at most 2 max|dz|), however
    # small the loss (0.29 was 1.3e-5 off; ALBERT's masked-LM + sentence-order loss was once
    # 1.17e-5 relative off, over the 1e-5 a relative bound gave it).
    logits = [v for k, v in expected.items() if k.endswith("logits") and v is not None]
    size = max([1.0, *(z.detach().abs().max().item() for z in logits)])
    assert_rel(loss, loss_of(expected), "loss", floor=2 * RELATIVE_ERROR * size)
    loss.backward()
    assert_same_grads(ours, theirs)
    real = batch["attention_mask"].bool()
    assert len(out.hidden_states) == len(expected.hidden_states) == layers + 1
    for i, (a, b) in enumerate(zip(out.hidden_states, expected.hidden_states)):
        assert_rel(a[real], b[real], f"hidden_states[{i}]")

    ours.eval()
    with torch.no_grad():
        evaluated = call(ours, batch)
    _compare_outputs(evaluated, expected, batch, per_token, per_sequence)

    ours.save_pretrained(tmp_path / "ours")
    again, info = hf_cls.from_pretrained(tmp_path / "ours", output_loading_info=True,
                                         attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        _compare_outputs(evaluated, call(again.eval(), batch), batch, per_token, per_sequence)


def assert_attentions_and_outputs_match(ours, theirs, batch: dict, layers: int) -> None:
    """With output_attentions and output_hidden_states, ours (the reference attention path)
    gives theirs' weights and hidden states at real tokens and the fused path's logits;
    the output indexes as transformers' (index, key, attribute, return_dict=False)."""
    names = inspect.signature(ours.forward).parameters  # DistilBERT takes no token types
    args = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in names}
    with torch.no_grad():
        a = ours(**args, output_attentions=True, output_hidden_states=True)
        b = theirs(**args, output_attentions=True, output_hidden_states=True)
        plain = ours(**args)
    assert type(a) is type(b)
    assert len(a.attentions) == len(b.attentions) == layers
    assert len(a.hidden_states) == len(b.hidden_states) == layers + 1
    real = batch["attention_mask"].bool()
    for x, y in zip(a.attentions, b.attentions):
        assert x.shape == y.shape
        # rows of real queries (a padding query's row differs in how the mask is added)
        assert_rel(x.transpose(1, 2)[real], y.transpose(1, 2)[real], "attentions")
    for x, y in zip(a.hidden_states, b.hidden_states):
        assert_rel(x[real], y[real], "hidden_states")
    at = (lambda t: t[real]) if a.logits.shape[:2] == real.shape else (lambda t: t)  # per token?
    assert_rel(at(a.logits), at(plain.logits), "logits with and without attentions")
    assert a[0] is a["logits"] is a.logits
    tupled = ours(**args, return_dict=False)
    assert isinstance(tupled, tuple) and torch.equal(tupled[0], plain.logits)


# --- what BERT's and ELECTRA's tests share ----------------------------------------------------

# Settings the fused encoder cannot honour: (config changes, the name its error gives).
REFUSED_SETTINGS = [
    ({"hidden_size": 30}, "hidden_size"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"is_decoder": True}, "is_decoder"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"chunk_size_feed_forward": 4}, "chunk_size_feed_forward"),
]


def tiny_config(config_cls, tiny: dict, **changes):
    """``config_cls`` of ``tiny`` with dropout off, eager attention, and ``changes``."""
    return config_cls(**{**tiny, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                         **changes}, attn_implementation="eager")


def file_tensors(folder) -> dict:
    """Every tensor of a checkpoint folder's safetensors files, by name."""
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def same_weights(cls, config) -> tuple:
    """(ours, theirs: transformers' class of the same name) of the same random weights, in
    eval mode."""
    import transformers

    theirs = getattr(transformers, cls.__name__)(config).eval()
    perturb(theirs)
    ours = cls(config).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def head_cases(family: str, **own) -> dict:
    """The cases of a model family's table: its ``own`` (ours, transformers' class name,
    {label argument: the batch entry it takes}, output fields per token, fields per
    sequence), then the heads BERT and ELECTRA share (sequence classification with one
    label per class, regression and multi-label; token classification; QA), of
    fusedlm.models' and transformers' classes named ``family`` + "For...". Each case ends
    with its config changes (an own case may give them as a sixth element)."""
    import fusedlm.models

    def case(head, renames, per_token, per_sequence, changes):
        return (getattr(fusedlm.models, family + head), family + head, renames, per_token, per_sequence,
                changes)

    sequence = "ForSequenceClassification"
    return {**{name: spec if len(spec) == 6 else spec + ({},) for name, spec in own.items()},
            "sequence": case(sequence, {"labels": "class_labels"}, (), ("logits",), {}),
            "regression": case(sequence, {"labels": "regression_labels"}, (), ("logits",), {"num_labels": 1}),
            "multi_label": case(sequence, {"labels": "multi_labels"}, (), ("logits",), {"num_labels": 3}),
            "token": case("ForTokenClassification", {"labels": "tag_labels"}, ("logits",), (), {}),
            "qa": case("ForQuestionAnswering", {}, ("start_logits", "end_logits"), (), {"num_labels": 2})}


def assert_case_matches_transformers(cases: dict, case: str, batch: dict, make_config, tiny: dict,
                                     backend, tmp_path) -> None:
    """assert_matches_transformers for one case of a head_cases table, on ``backend``. The
    loss is the head's own; for the base model ("model") a random weighting of the last
    hidden state at real tokens (padding positions differ by design) plus the pooler output
    where there is one; for "qa" transformers' QA loss over the real tokens."""
    import transformers

    cls, hf_name, renames, per_token, per_sequence, changes = cases[case]
    weight = torch.randn(int(batch["attention_mask"].sum()), tiny["hidden_size"])
    batch = {**batch, **{k: batch[v] for k, v in renames.items()}}

    def loss_of(out):
        if case == "model":
            loss = (out.last_hidden_state[batch["attention_mask"].bool()] * weight).sum()
            pooled = getattr(out, "pooler_output", None)
            return loss if pooled is None else loss + pooled.sum()
        if case == "qa":
            return qa_reference_loss(out.start_logits, out.end_logits, batch)
        return out.loss

    fusedlm.set_backend(backend)
    try:
        assert_matches_transformers(cls, getattr(transformers, hf_name), make_config(**changes), batch,
                                    loss_of, per_token, per_sequence, tiny["num_hidden_layers"], tmp_path)
    finally:
        fusedlm.set_backend(None)


def parity_test(cases: dict, make_batch, make_config, tiny: dict):
    """The test of every case of a head_cases table on the cpu and reference backends:
    assert_case_matches_transformers on ``make_batch()``."""
    @pytest.mark.parametrize("backend", ["cpu", "reference"])
    @pytest.mark.parametrize("case", list(cases))
    def test(case, backend, tmp_path):
        assert_case_matches_transformers(cases, case, make_batch(), make_config, tiny, backend, tmp_path)
    return test


def assert_unpadded_masked_lm_matches(cls, hf_cls, config, layers: int, tmp_path) -> None:
    """assert_matches_transformers for a masked-LM head on a batch without padding (the
    unpacked path)."""
    batch = parity_batch(config.vocab_size, (12, 12, 12))
    assert_matches_transformers(cls, hf_cls, config, batch, lambda out: out.loss, ("logits",), (), layers,
                                tmp_path)


def assert_embeds_and_positions_match(cls, config, batch: dict, width: int) -> None:
    """Base models (ours and transformers', same_weights) given inputs_embeds [B, T, width]
    (no input_ids), or reversed position_ids, give the same last hidden state at real
    tokens, and the same pooler output where there is one."""
    ours, theirs = same_weights(cls, config)
    real = batch["attention_mask"].bool()
    embeds = torch.randn(*batch["input_ids"].shape, width)
    positions = torch.arange(12).flip(0).expand(3, 12)
    for extra in ({"inputs_embeds": embeds}, {"position_ids": positions}):
        args = {"attention_mask": batch["attention_mask"], "token_type_ids": batch["token_type_ids"],
                **({"input_ids": batch["input_ids"]} if "inputs_embeds" not in extra else {}), **extra}
        with torch.no_grad():
            a, b = ours(**args), theirs(**args)
        assert_rel(a.last_hidden_state[real], b.last_hidden_state[real], str(list(extra)))
        if getattr(b, "pooler_output", None) is not None:
            assert_rel(a.pooler_output, b.pooler_output, "pooler_output")


def assert_encoder_weights_load(hf_cls, cls, config, parts: tuple, count: int, tmp_path) -> None:
    """transformers' ``hf_cls`` (base or task model) saved, our ``cls`` (base or task model)
    loads every encoder weight (the ``count`` tensors under ``parts`` of the base model) as
    saved, reporting none of them missing."""
    theirs = hf_cls(config)
    perturb(theirs)
    theirs.save_pretrained(tmp_path)
    base = theirs.base_model_prefix + "."
    prefix = "" if theirs.base_model is theirs else base
    model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    ours = model.state_dict()
    ours_prefix = "" if model.base_model is model else base
    encoder = {k[len(prefix):]: v for k, v in file_tensors(tmp_path).items()
               if k.startswith(tuple(prefix + p for p in parts))}
    assert len(encoder) == count
    for name, value in encoder.items():
        assert torch.equal(ours[ours_prefix + name], value), name
    assert not any(k.startswith(tuple(p + part for p in ("", base) for part in parts))
                   for k in info["missing_keys"]), info["missing_keys"]


def assert_untied_head_loads_both_ways(cls, hf_cls, config, batch: dict, tmp_path):
    """A masked-LM checkpoint whose output embeddings are not tied to the input embeddings
    loads its own head weight, gives transformers' logits, and saves it back: ours."""
    theirs = hf_cls(config).eval()
    perturb(theirs)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = cls.from_pretrained(tmp_path / "theirs").eval()
    head = ours.get_output_embeddings().weight
    assert head is not ours.get_input_embeddings().weight
    assert torch.equal(head, theirs.get_output_embeddings().weight)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        assert_rel(call(ours, batch).logits[real], call(theirs, batch).logits[real], "untied logits")
    ours.save_pretrained(tmp_path / "ours")
    again = hf_cls.from_pretrained(tmp_path / "ours")
    assert torch.equal(again.get_output_embeddings().weight, head)
    return ours


def assert_no_logits_in_training_unless_asked(model, batch: dict, shape: tuple) -> None:
    """A masked-LM head in training with labels builds no logits (the fused loss), unless
    return_logits (then ``shape``, the same loss); in eval it builds them."""
    fused = call(model.train(), batch)
    assert fused.logits is None
    full = call(model, batch, return_logits=True)
    assert full.logits.shape == shape
    assert_rel(fused.loss, full.loss, "loss")
    assert call(model.eval(), batch).logits is not None


def count_attention_runs(model) -> list:
    """A list that gets an entry each time one of the model's layers (transformers'
    GradientCheckpointingLayer) runs its attention."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    runs = []
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.attention.register_forward_hook(lambda *_: runs.append(1))
    return runs


def graph_nodes(t: torch.Tensor) -> set:
    """The names of the autograd nodes t's backward runs through."""
    names, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def assert_checkpointing_matches_transformers(cls, config, batch: dict, calls: int, use_reentrant: bool) -> None:
    """``cls`` (a masked-LM head) with gradient_checkpointing_enable(gradient_checkpointing_kwargs=
    {"use_reentrant": ...}) recomputes each of its ``calls`` layer calls in the backward, with
    torch's reentrant checkpoint or not as asked, and gives the loss and gradients of
    transformers' model of the same weights (checkpointed the same way where it can be)."""
    ours, theirs = same_weights(cls, config)
    options = {"use_reentrant": use_reentrant}
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if theirs.supports_gradient_checkpointing:
        theirs.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    expected = call(theirs.train(), batch).loss
    expected.backward()
    runs = count_attention_runs(ours)
    loss = call(ours.train(), batch).loss
    assert len(runs) == calls
    assert ("CheckpointFunctionBackward" in graph_nodes(loss)) == use_reentrant
    loss.backward()
    assert len(runs) == 2 * calls  # every layer call ran again in the backward
    assert_rel(loss, expected, "loss")
    assert_same_grads(ours, theirs)


def tiny_batch() -> dict:
    """The padded batch the model families' tests share: VOCAB tokens, rows of LENGTHS."""
    return parity_batch(VOCAB, LENGTHS)


def encoder_family_tests(cases: dict, make_config, tiny: dict, *, checkpoints: list, encoder: tuple,
                         encoder_weights: int, output_embeddings, make_batch=tiny_batch,
                         layers=None) -> dict:
    """The tests every encoder family (BERT and its kin) runs against transformers, by name,
    for its test module's globals:
    - every case of ``cases`` (head_cases) on ``make_batch()``, on the cpu and reference
      backends (``layers``: the hidden states recorded, by default num_hidden_layers);
    - the masked-LM head on a batch without padding (the unpacked path); untied from the
      input embeddings (``output_embeddings(model)``: the module holding its weight); and
      in training, building no logits unless asked;
    - gradient checkpointing with use_reentrant True and False (the masked-LM head);
    - checkpoints base <-> task both ways (``checkpoints``: (transformers' class name saved,
      our class loading)), each with every one of the ``encoder_weights`` tensors under the
      ``encoder`` key prefixes."""
    import transformers

    masked_lm, theirs_masked_lm = cases["masked_lm"][0], getattr(transformers, cases["masked_lm"][1])
    layers = tiny["num_hidden_layers"] if layers is None else layers

    def test_without_padding_the_unpacked_path_matches_transformers(tmp_path):
        assert_unpadded_masked_lm_matches(masked_lm, theirs_masked_lm, make_config(), layers, tmp_path)

    @pytest.mark.parametrize("saved, loaded", checkpoints)
    def test_base_and_task_checkpoints_load_both_ways_with_every_encoder_weight(saved, loaded, tmp_path):
        assert_encoder_weights_load(getattr(transformers, saved), loaded, make_config(), encoder,
                                    encoder_weights, tmp_path)

    def test_untied_decoder_loads_its_own_weight_both_ways(tmp_path):
        ours = assert_untied_head_loads_both_ways(masked_lm, theirs_masked_lm,
                                                  make_config(tie_word_embeddings=False), make_batch(),
                                                  tmp_path)
        assert ours.get_output_embeddings() is output_embeddings(ours)

    def test_masked_lm_in_training_builds_no_logits_unless_asked():
        assert_no_logits_in_training_unless_asked(masked_lm(make_config()), make_batch(),
                                                  (len(LENGTHS), max(LENGTHS), VOCAB))

    @pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
    def test_gradient_checkpointing_kwargs_are_honoured_with_transformers_gradients(use_reentrant):
        assert_checkpointing_matches_transformers(masked_lm, make_config(), make_batch(), layers, use_reentrant)

    tests = {name: test for name, test in locals().items() if name.startswith("test_")}
    parity = parity_test(cases, make_batch, make_config, {**tiny, "num_hidden_layers": layers})
    return {"test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients": parity, **tests}
