"""fusedlm.models end to end: training steps and inference, against the same model pinned to
the reference backend and, for BERT and GPT, transformers' model with the same weights.

A small config, so that the whole file runs in minutes on two CPU cores: hidden 256, 4
layers, 4 heads, FFN 1024, vocab 8192, batch 8 x seq 128. BERT and ELECTRA batches are
padded (lengths uniform in [64, 128]) with 15% of the real tokens labelled; GPT's are
full. ELMo: LSTM cell 512, projection 128, four small filters, 16 sentences of up to 20
words. "reference" is the fusedlm model itself with every op forced to the plain-PyTorch
reference backend, so its ratio is what the kernels buy inside the model. Every model is
randomly initialised and in training mode (dropout on) for the training steps. A step
takes up to seconds, so each side runs a few rounds only.
"""
import contextlib
import random
import string
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedlm  # noqa: E402
from fusedlm import models  # noqa: E402
from conftest import role  # noqa: E402

BATCH, SEQ, HIDDEN, LAYERS, HEADS, FFN, VOCAB = 8, 128, 256, 4, 4, 1024, 8192
LABELLED = 0.15
PROMPT, NEW_TOKENS = 16, 32
ELMO_BATCH, ELMO_WORDS = 16, 20

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="no CUDA device"))]
_MODELS = {}


@contextlib.contextmanager
def pinned(impl: str):
    """Forces every op to the reference backend for the "reference" side; restores the
    previous choice after, so that the other sides keep automatic dispatch."""
    previous = fusedlm.get_backend()
    if impl == "reference":
        fusedlm.set_backend("reference")
    try:
        yield
    finally:
        fusedlm.set_backend(previous)


def measure(benchmark, device: str, fn, tokens: int) -> None:
    """A few timed rounds of fn, pinned per the benchmark's impl; tokens/s of the fastest."""
    impl = benchmark.extra_info["impl"]

    def step():
        with pinned(impl):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=3, warmup_rounds=1, iterations=1)
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = round(tokens / benchmark.stats.stats.min, 1)


def built(key: tuple, build):
    """Builds each model once per session (and device): building and converting is slow."""
    if key not in _MODELS:
        _MODELS[key] = build()
    return _MODELS[key]


def as_transformers(model, cls, device: str):
    """transformers' model with model's weights, through a checkpoint in its layout."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return cls.from_pretrained(tmp, attn_implementation="sdpa").to(device)


def padded_batch(device: str) -> dict:
    """Ids, a right-padding attention_mask (lengths uniform in [SEQ/2, SEQ]) and labels on
    LABELLED of the real tokens."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), device=device)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), device=device)
    mask = (torch.arange(SEQ, device=device) < lengths[:, None]).long()
    ids = ids * mask
    picked = (torch.rand(ids.shape, device=device) < LABELLED) & mask.bool()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~picked, -100)}


def train_step(model, batch: dict):
    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    return step


# --- BERT ----------------------------------------------------------------------------------------

def bert(device: str, impl: str, training: bool):
    def build():
        config = models.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, intermediate_size=FFN)
        ours = models.BertForMaskedLM(config).to(device)
        return {"fusedlm": ours, "reference": ours,
                "transformers": as_transformers(ours, transformers.BertForMaskedLM, device)}
    return built(("bert", device), build)[impl].train(training)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "reference", "transformers"])
def test_bert_mlm_training_step(benchmark, device, impl):
    role(benchmark, f"BERT MLM training step {device} [{BATCH}x{SEQ} padded, 15% labelled]", impl)
    batch = padded_batch(device)
    measure(benchmark, device, train_step(bert(device, impl, True), batch),
            int(batch["attention_mask"].sum()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "transformers"])
def test_bert_eval_forward(benchmark, device, impl):
    role(benchmark, f"BERT MLM eval forward {device} [{BATCH}x{SEQ} padded, logits]", impl)
    model = bert(device, impl, False)
    batch = padded_batch(device)
    del batch["labels"]

    @torch.no_grad()
    def forward():
        model(**batch)

    measure(benchmark, device, forward, int(batch["attention_mask"].sum()))


# --- ELECTRA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "reference"])
def test_electra_pretraining_step(benchmark, device, impl):
    role(benchmark, f"ELECTRA pretraining step {device} [{BATCH}x{SEQ} padded, 15% masked]", impl)

    def build():
        config = models.ElectraConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, intermediate_size=FFN)
        return models.ElectraForPreTraining(config).to(device)

    model = built(("electra", device), build).train()
    batch = padded_batch(device)
    ids, labels = models.mask_tokens(batch["input_ids"], mask_token_id=103, vocab_size=VOCAB,
                                     special_token_ids=(0,), attention_mask=batch["attention_mask"],
                                     probability=LABELLED)
    step = train_step(model, {"input_ids": ids, "attention_mask": batch["attention_mask"],
                              "labels": labels})
    measure(benchmark, device, step, int(batch["attention_mask"].sum()))


# --- GPT -----------------------------------------------------------------------------------------

def gpt(device: str, impl: str, training: bool):
    def build():
        # The default eos id (50256) lies outside this vocabulary, so both sides' greedy
        # decoding always runs the full NEW_TOKENS steps.
        config = models.GPTConfig(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=HIDDEN,
                                  n_layer=LAYERS, n_head=HEADS, n_inner=FFN)
        ours = models.GPTLMHeadModel(config).to(device)
        return {"fusedlm": ours, "reference": ours,
                "transformers": as_transformers(ours, transformers.GPT2LMHeadModel, device)}
    return built(("gpt", device), build)[impl].train(training)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "reference", "transformers"])
def test_gpt_lm_training_step(benchmark, device, impl):
    role(benchmark, f"GPT LM training step {device} [{BATCH}x{SEQ}]", impl)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    step = train_step(gpt(device, impl, True), {"input_ids": ids, "labels": ids})
    measure(benchmark, device, step, ids.numel())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "transformers"])
def test_gpt_generate(benchmark, device, impl):
    role(benchmark, f"GPT greedy generate {device} [1x{PROMPT} prompt, {NEW_TOKENS} new tokens]", impl)
    model = gpt(device, impl, False)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), device=device)
    mask = torch.ones_like(prompt)
    if impl == "transformers":
        def generate():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                                 pad_token_id=0)
            assert out.shape[1] == PROMPT + NEW_TOKENS
    else:
        def generate():
            out = model.generate(prompt, mask, max_new_tokens=NEW_TOKENS)
            assert out.shape[1] == PROMPT + NEW_TOKENS
    measure(benchmark, device, generate, NEW_TOKENS)


# --- ELMo ----------------------------------------------------------------------------------------

def elmo_config() -> "models.ElmoConfig":
    return models.ElmoConfig(lstm_dim=512, projection_dim=128, filters=[[1, 32], [2, 32], [3, 64], [4, 128]],
                             n_highway=1, vocab_size=VOCAB)


def sentences(device: str):
    """Character ids of ELMO_BATCH random sentences of 10 to ELMO_WORDS lowercase words."""
    rng = random.Random(0)
    words = [["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 10)))
              for _ in range(rng.randint(10, ELMO_WORDS))] for _ in range(ELMO_BATCH)]
    return models.elmo.batch_to_ids(words).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "reference"])
def test_elmo_bilm_training_step(benchmark, device, impl):
    role(benchmark, f"ELMo biLM training step {device} [{ELMO_BATCH}x{ELMO_WORDS} words]", impl)
    model = built(("elmo-bilm", device), lambda: models.ElmoBiLM(elmo_config()).to(device)).train()
    char_ids = sentences(device)
    real = (char_ids > 0).any(-1)
    word_ids = torch.randint(0, VOCAB, real.shape, device=device).masked_fill(~real, -100)
    step = train_step(model, {"char_ids": char_ids, "word_ids": word_ids})
    measure(benchmark, device, step, int(real.sum()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fusedlm", "reference"])
def test_elmo_embed(benchmark, device, impl):
    role(benchmark, f"ELMo embed forward {device} [{ELMO_BATCH}x{ELMO_WORDS} words]", impl)
    model = built(("elmo", device), lambda: models.ELMo(elmo_config()).to(device)).eval()
    char_ids = sentences(device)

    @torch.no_grad()
    def embed():
        model.embed(char_ids)

    measure(benchmark, device, embed, int((char_ids > 0).any(-1).sum()))
