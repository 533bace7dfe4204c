"""ELMo against a plain float64 reference written from the published equations (bilm-tf's
TensorFlow layout: x @ W, gates i, j, f, o, forget bias + 1, carry-gated highways), the
reading of AllenNLP's weights.hdf5, the character ids, ElmoBiLM's training, and what the
models take from transformers (save/load, init, outputs, config checks)."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fusedlm
from fusedlm.models.elmo import ELMo, ElmoBiLM, ElmoConfig, batch_to_ids, word_to_char_ids
from fusedlm.ops import reference
from helpers import as_reference, assert_close, backend_device, backends_for, fresh, slow_backend

h5py = pytest.importorskip("h5py")

OPTIONS = {
    "char_cnn": {"activation": "relu", "embedding": {"dim": 4}, "filters": [[1, 4], [2, 6], [3, 8]],
                 "max_characters_per_token": 50, "n_characters": 261, "n_highway": 2},
    "lstm": {"cell_clip": 0.6, "dim": 10, "n_layers": 2, "proj_clip": 0.25, "projection_dim": 6,
             "use_skip_connections": True},
}
SENTENCES = [["The", "cat", "sat", "."], ["Über", "naïve"], ["a" * 60, "b", "c", "d", "e", "f"]]


def _config(**overrides):
    return ElmoConfig.from_options(OPTIONS, **{"n_characters": 262, "dropout": 0.0, **overrides})


# --- the plain reference ---------------------------------------------------------------------------

def _random_tf_weights(config):
    """bilm-tf's datasets, random (scaled so the clips and the gates are all exercised)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))

    def rand(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).numpy()

    dim, n = config.char_embedding_dim, sum(c for _, c in config.filters)
    cell, proj = config.lstm_dim, config.projection_dim
    w = {"char_embed": rand(config.n_characters - 1, dim, scale=1.0),
         "CNN_proj/W_proj": rand(n, proj), "CNN_proj/b_proj": rand(proj)}
    for i, (width, channels) in enumerate(config.filters):
        w[f"CNN/W_cnn_{i}"], w[f"CNN/b_cnn_{i}"] = rand(1, width, dim, channels), rand(channels)
    for k in range(config.n_highway):
        for part in ("transform", "carry"):
            w[f"CNN_high_{k}/W_{part}"], w[f"CNN_high_{k}/b_{part}"] = rand(n, n, scale=0.3), rand(n)
    for d in range(2):
        for layer in range(config.n_layers):
            path = f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            w[f"{path}/W_0"], w[f"{path}/B"] = rand(2 * proj, 4 * cell), rand(4 * cell)
            w[f"{path}/W_P_0"] = rand(cell, proj)
    return w


def _tf_weights_of(model):
    """The inverse of the hdf5 reading: a model's parameters in bilm-tf's layout."""
    s = {k: v.detach().double() for k, v in model.state_dict().items()}
    cfg = model.config
    n, cell = sum(c for _, c in cfg.filters), cfg.lstm_dim
    w = {"char_embed": s["char_encoder.embedding.weight"][1:],
         "CNN_proj/W_proj": s["char_encoder.projection.weight"].t(),
         "CNN_proj/b_proj": s["char_encoder.projection.bias"]}
    for i in range(len(cfg.filters)):
        w[f"CNN/W_cnn_{i}"] = s[f"char_encoder.convs.{i}.weight"].permute(2, 1, 0)[None]
        w[f"CNN/b_cnn_{i}"] = s[f"char_encoder.convs.{i}.bias"]
    for k in range(cfg.n_highway):
        weight, bias = s[f"char_encoder.highways.{k}.weight"], s[f"char_encoder.highways.{k}.bias"]
        w[f"CNN_high_{k}/W_transform"], w[f"CNN_high_{k}/b_transform"] = weight[:n].t(), bias[:n]
        w[f"CNN_high_{k}/W_carry"], w[f"CNN_high_{k}/b_carry"] = -weight[n:].t(), -bias[n:]
    for d, name in enumerate(("forward_layers", "backward_layers")):
        for layer in range(cfg.n_layers):
            p, path = f"lstm.{name}.{layer}", f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            i, f, g, o = [slice(j * cell, (j + 1) * cell) for j in range(4)]

            def tf_order(t):
                return torch.cat([t[i], t[g], t[f], t[o]])

            both = torch.cat([s[f"{p}.input_linearity.weight"], s[f"{p}.state_linearity.weight"]], 1)
            bias = s[f"{p}.state_linearity.bias"].clone()
            bias[f] -= 1.0
            w[f"{path}/W_0"], w[f"{path}/B"] = tf_order(both).t(), tf_order(bias)
            w[f"{path}/W_P_0"] = s[f"{p}.state_projection.weight"].t()
    return {k: torch.as_tensor(v).numpy() for k, v in w.items()}


def _reference_layers(w, config, sentence, clipped):
    """The three layers [len + 2, 2 * proj] of one sentence, markers included."""
    t = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in w.items()}
    ids = torch.tensor([word_to_char_ids(x, config.max_characters_per_token) for x in ["<S>", *sentence, "</S>"]])
    table = torch.cat([torch.zeros(1, config.char_embedding_dim, dtype=torch.float64), t["char_embed"]])
    emb = table[ids]  # [words, chars, dim]
    feats = []
    for i, (width, _) in enumerate(config.filters):
        kernel = t[f"CNN/W_cnn_{i}"][0]  # [width, dim, channels]
        windows = emb.unfold(1, width, 1)  # [words, positions, dim, width]
        conv = torch.einsum("npdk,kdc->npc", windows, kernel) + t[f"CNN/b_cnn_{i}"]
        feats.append(torch.relu(conv.max(dim=1).values))
    x = torch.cat(feats, dim=-1)
    for k in range(config.n_highway):
        carry = torch.sigmoid(x @ t[f"CNN_high_{k}/W_carry"] + t[f"CNN_high_{k}/b_carry"])
        x = carry * torch.relu(x @ t[f"CNN_high_{k}/W_transform"] + t[f"CNN_high_{k}/b_transform"]) \
            + (1 - carry) * x
    x = x @ t["CNN_proj/W_proj"] + t["CNN_proj/b_proj"]

    def run(inputs, path):
        h, c, out = torch.zeros(config.projection_dim, dtype=torch.float64), 0.0, []
        for step in inputs:
            i, j, f, o = (torch.cat([step, h]) @ t[f"{path}/W_0"] + t[f"{path}/B"]).chunk(4)
            c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(j)
            if config.cell_clip is not None:
                clipped[0] += int((c.abs() > config.cell_clip).sum())
                c = c.clamp(-config.cell_clip, config.cell_clip)
            h = (torch.sigmoid(o) * torch.tanh(c)) @ t[f"{path}/W_P_0"]
            if config.proj_clip is not None:
                clipped[1] += int((h.abs() > config.proj_clip).sum())
                h = h.clamp(-config.proj_clip, config.proj_clip)
            out.append(h)
        return torch.stack(out)

    layers, fwd, bwd = [torch.cat([x, x], -1)], x, x.flip(0)
    for layer in range(config.n_layers):
        cell = f"RNN/MultiRNNCell/Cell{layer}/LSTMCell"
        f_out, b_out = run(fwd, f"RNN_0/{cell}"), run(bwd, f"RNN_1/{cell}")
        if layer > 0:
            f_out, b_out = f_out + fwd, b_out + bwd
        fwd, bwd = f_out, b_out
        layers.append(torch.cat([fwd, bwd.flip(0)], -1))
    return layers


def _reference_mix(layers, scalars, gamma, do_layer_norm):
    if do_layer_norm:
        layers = [(h - h.mean()) / torch.sqrt(h.var(unbiased=False) + 1e-12) for h in layers]
    weights = torch.softmax(torch.as_tensor(scalars, dtype=torch.float64), 0)
    return float(gamma) * sum(wt * h for wt, h in zip(weights, layers))


def _check_against_reference(model, w, sentences=SENTENCES):
    model.eval()
    out = model(batch_to_ids(sentences))
    clipped = [0, 0]
    for b, sentence in enumerate(sentences):
        n = len(sentence)
        layers = _reference_layers(w, model.config, sentence, clipped)
        for got, want in zip(out.hidden_states, layers):
            torch.testing.assert_close(got[b, :n].double(), want[1:-1], atol=1e-5, rtol=1e-4)
            assert not got[b, n:].any()  # positions past the sentence are zeros
        for mix, rep in zip(model.mixes, out.representations):
            want = _reference_mix(layers, mix.scalars.detach(), mix.gamma.detach(),
                                  model.config.do_layer_norm)
            torch.testing.assert_close(rep[b, :n].double(), want[1:-1], atol=1e-5, rtol=1e-4)
    longest = max(len(s) for s in sentences)
    assert out.mask.tolist() == [[t < len(s) for t in range(longest)] for s in sentences]
    return clipped


def _shuffle_mixes(model, lstm_scale=1.0):
    """Random mixes; LSTM weights scaled by lstm_scale (up from their initial values, the
    clips are reached)."""
    with torch.no_grad():
        for mix in model.mixes:
            mix.scalars.normal_()
            mix.gamma.uniform_(0.5, 2.0)
        for p in model.lstm.parameters():
            p.mul_(lstm_scale)


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_elmo_matches_the_plain_reference(backend):
    torch.manual_seed(0)
    model = ELMo(_config(num_output_representations=2))
    _shuffle_mixes(model, lstm_scale=4.0)
    with fusedlm.use_backend(backend):
        clipped = _check_against_reference(model, _tf_weights_of(model))
    assert clipped[0] > 0 and clipped[1] > 0  # both clips were exercised


def test_scalar_mix_with_layer_norm():
    model = ELMo(_config(do_layer_norm=True))
    _shuffle_mixes(model, lstm_scale=4.0)
    # The reference normalises each sentence's layer alone: one sentence per batch.
    _check_against_reference(model, _tf_weights_of(model), SENTENCES[:1])


def test_allennlp_hdf5_loads_and_matches_the_reference(tmp_path):
    config = _config()
    weights = _random_tf_weights(config)
    with h5py.File(tmp_path / "weights.hdf5", "w") as f:
        for name, value in weights.items():
            f.create_dataset(name, data=value.astype("float32"))
        # AllenNLP skips datasets it does not use (bilm-tf also writes the softmax).
        f.create_dataset("softmax/W", data=torch.randn(7, 6).numpy())
    (tmp_path / "options.json").write_text(json.dumps(OPTIONS))

    model = ELMo.from_allennlp(tmp_path / "options.json", tmp_path / "weights.hdf5", dropout=0.0)
    assert model.config.n_characters == 262 and model.config.lstm_dim == 10
    assert not model.char_encoder.embedding.weight[0].any()  # the padding row
    _shuffle_mixes(model)
    rounded = {k: v.astype("float32") for k, v in weights.items()}
    clipped = _check_against_reference(model, rounded)
    assert clipped[0] > 0 and clipped[1] > 0

    bad = json.loads(json.dumps(OPTIONS))
    bad["lstm"]["dim"] = 11
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"):
        ELMo.from_allennlp(tmp_path / "bad.json", tmp_path / "weights.hdf5")


def test_character_ids():
    ids = word_to_char_ids("ab")
    assert ids[:4] == [259, 98, 99, 260] and ids[4:] == [261] * 46 and len(ids) == 50
    assert word_to_char_ids("<S>")[:4] == [259, 257, 260, 261]
    assert word_to_char_ids("</S>")[:4] == [259, 258, 260, 261]
    assert word_to_char_ids("é")[:4] == [259, 0xC3 + 1, 0xA9 + 1, 260]  # UTF-8 bytes
    long = word_to_char_ids("x" * 60)  # cut to 48 bytes between the two markers
    assert long[0] == 259 and long[1:49] == [ord("x") + 1] * 48 and long[49] == 260
    batch = batch_to_ids([["a", "b", "c"], ["d"]])
    assert batch.shape == (2, 3, 50) and batch.dtype == torch.long
    assert not batch[1, 1:].any() and batch[1, 0, 1] == ord("d") + 1
    assert batch_to_ids([["hi"]], max_characters_per_token=8)[0, 0].tolist() == \
        [259, 105, 106, 260, 261, 261, 261, 261]


def test_lstm_loop_equals_torch_lstm_without_clipping():
    model = ELMo(_config(cell_clip=None, proj_clip=None))
    layers = [*model.lstm.forward_layers, *model.lstm.backward_layers]
    assert all(layer.use_torch_lstm for layer in layers)
    ids = batch_to_ids(SENTENCES)
    outs, grads = [], []
    for use_torch in (True, False):
        for layer in layers:
            layer.use_torch_lstm = use_torch
        model.zero_grad()
        out = model(ids)
        (out.last_hidden_state * torch.linspace(-1, 1, 12)).sum().backward()
        outs.append(out.hidden_states)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-5, rtol=1e-4, msg=k)


def _elmo_fields(config):
    return {name: getattr(config, name) for name in ElmoConfig.__annotations__}


def test_save_and_load_pretrained(tmp_path):
    model = ELMo(_config(num_output_representations=2))
    _shuffle_mixes(model)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = ELMo.from_pretrained(tmp_path)
    assert type(loaded.config) is ElmoConfig and _elmo_fields(loaded.config) == _elmo_fields(model.config)
    model.eval(), loaded.eval()
    ids = batch_to_ids(SENTENCES)
    expected, out = model(ids), loaded(ids)
    for name in ("last_hidden_state", "mask"):
        torch.testing.assert_close(out[name], expected[name], rtol=0, atol=0)
    for got, want in zip(out.representations + list(out.hidden_states),
                         expected.representations + list(expected.hidden_states)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    ids, word_ids, vocab = _corpus()
    bilm = ElmoBiLM(_config(vocab_size=vocab))
    bilm.save_pretrained(tmp_path / "bilm")
    again = ElmoBiLM.from_pretrained(tmp_path / "bilm")
    assert torch.equal(again(ids, word_ids).loss, bilm(ids, word_ids).loss)
    # ELMo from a biLM checkpoint: the mixes start from their init, the softmax stays out.
    elmo, info = ELMo.from_pretrained(tmp_path / "bilm", output_loading_info=True)
    assert set(info["missing_keys"]) == {"mixes.0.scalars", "mixes.0.gamma"}
    assert set(info["unexpected_keys"]) == {"softmax_weight", "softmax_bias"}
    assert not elmo.mixes[0].scalars.any() and elmo.mixes[0].gamma.item() == 1.0


def test_a_missing_tensor_is_reported_and_initialised_as_elmo_does(tmp_path):
    model = ELMo(_config())
    _shuffle_mixes(model)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for name in ("mixes.0.gamma", "char_encoder.highways.1.bias"):
        del weights[name]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = ELMo.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["char_encoder.highways.1.bias", "mixes.0.gamma"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.mixes[0].gamma.item() == 1.0
    n = loaded.char_encoder.highways[1].in_features
    assert (loaded.char_encoder.highways[1].bias[n:] == 1).all()  # the gate carries its input
    # Every tensor the file holds is loaded as it was, its module's missing one aside.
    state = model.state_dict()
    for name, value in loaded.state_dict().items():
        if name in weights:
            assert torch.equal(value, state[name]), name


def test_init_is_elmos_own():
    """transformers' weight init runs at construction: ELMo's own (torch's defaults, open
    highway gates, even mixes), not transformers' small normal init."""
    model = ElmoBiLM(_config(vocab_size=2000, num_output_representations=1))
    encoder = model.char_encoder
    assert not encoder.embedding.weight[0].any()  # the padding row
    assert 0.9 < encoder.embedding.weight[1:].std().item() < 1.1  # torch's N(0, 1)
    for layer in [*encoder.convs, *encoder.highways, encoder.projection, *model.lstm.modules()]:
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv1d)):
            fan_in = layer.weight[0].numel()  # torch's uniform(+-1/sqrt(fan_in))
            assert layer.weight.abs().max().item() <= fan_in ** -0.5
            assert layer.weight.abs().max().item() > 0.5 * fan_in ** -0.5
    for highway in encoder.highways:
        assert (highway.bias[highway.in_features:] == 1).all()
    std = model.softmax_weight.std().item() * model.config.projection_dim ** 0.5
    assert 0.9 < std < 1.1 and not model.softmax_bias.any()
    elmo = ELMo(_config(num_output_representations=2))
    assert all(not mix.scalars.any() and mix.gamma.item() == 1.0 for mix in elmo.mixes)


def test_device_dtype_and_output_access():
    model = ELMo(_config()).eval()
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    out = model(batch_to_ids(SENTENCES))
    assert out[0] is out.last_hidden_state is out["last_hidden_state"]
    assert out["representations"] is out.representations and out[1] is out.representations
    fields = (out.last_hidden_state, out.representations, out.hidden_states, out.mask)
    assert len(out.to_tuple()) == 4 and all(a is b for a, b in zip(out.to_tuple(), fields))
    ids, word_ids, vocab = _corpus()
    bilm = ElmoBiLM(_config(vocab_size=vocab))
    trained = bilm(ids, word_ids)
    assert trained[0] is trained.loss and trained["hidden_states"] is trained.hidden_states
    untrained = bilm(ids)  # fields that are None are left out, as in transformers
    assert untrained[0] is untrained.hidden_states and len(untrained.to_tuple()) == 1


def test_bad_config_values_are_rejected_naming_them(tmp_path):
    with pytest.raises(ValueError, match="lstm_dim"):
        ElmoConfig(lstm_dim=0)
    with pytest.raises(ValueError, match="proj_clip"):
        ElmoConfig(proj_clip=-1.0)
    with pytest.raises(Exception, match="n_layers"):  # transformers' check of the type
        ElmoConfig(n_layers="two")
    ELMo(_config()).save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "activation": "gelu"}))
    with pytest.raises(ValueError, match="activation"):
        ELMo.from_pretrained(tmp_path)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = batch_to_ids(SENTENCES)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(3)
        model = ELMo(_config(gradient_checkpointing=checkpointing))
        assert model.lstm.gradient_checkpointing is checkpointing
        model(ids).last_hidden_state.square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_bilm_under_bfloat16_autocast():
    ids, word_ids, vocab = _corpus()
    model = ElmoBiLM(_config(vocab_size=vocab))
    full = model(ids, word_ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = model(ids, word_ids)
    assert half.hidden_states[-1].dtype == torch.bfloat16
    half.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.testing.assert_close(half.loss.float(), full, atol=0.05, rtol=0.02)


def _corpus():
    """Sentences of a tiny language whose next word follows from the current one."""
    words = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "rug", "."]
    successor = {w: words[(i * 3 + 1) % len(words)] for i, w in enumerate(words)}
    g = torch.Generator().manual_seed(1)
    sentences = []
    for _ in range(8):
        word, sentence = words[int(torch.randint(len(words), (), generator=g))], []
        for _ in range(int(torch.randint(3, 7, (), generator=g))):
            sentence.append(word)
            word = successor[word]
        sentences.append(sentence)
    vocab = {w: i for i, w in enumerate(words)}
    word_ids = torch.full((len(sentences), 6), -100)
    for b, s in enumerate(sentences):
        word_ids[b, :len(s)] = torch.tensor([vocab[w] for w in s])
    return batch_to_ids(sentences), word_ids, len(words)


def _train(backend, steps, ids, word_ids, vocab):
    torch.manual_seed(5)
    model = ElmoBiLM(_config(vocab_size=vocab, cell_clip=3.0, proj_clip=3.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with fusedlm.use_backend(backend):
            loss = model(ids, word_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses



def test_bilm_trains_and_backends_agree(one_thread):
    ids, word_ids, vocab = _corpus()
    losses = _train("cpu", 120, ids, word_ids, vocab)
    assert losses[-1] < 0.8 * losses[0], losses[::10]
    reference = _train("reference", 20, ids, word_ids, vocab)
    torch.testing.assert_close(torch.tensor(losses[:20]), torch.tensor(reference), atol=2e-4, rtol=2e-4)


def test_bilm_loss_counts_the_words_of_both_directions():
    ids, word_ids, vocab = _corpus()
    model = ElmoBiLM(_config(vocab_size=vocab))
    out = model(ids, word_ids)
    top = out.hidden_states[-1].detach()
    proj = model.config.projection_dim
    w, b = model.softmax_weight.detach(), model.softmax_bias.detach()
    fwd, bwd = [], []
    for s in range(ids.shape[0]):
        n = int((word_ids[s] >= 0).sum())
        # markers at 0 and n + 1: forward positions 0..n-1 predict words 0..n-1; backward
        # positions 2..n+1 predict them too.
        fwd.append(torch.nn.functional.cross_entropy(top[s, :n, :proj] @ w.t() + b, word_ids[s, :n],
                                                     reduction="sum"))
        bwd.append(torch.nn.functional.cross_entropy(top[s, 2:n + 2, proj:] @ w.t() + b,
                                                     word_ids[s, :n], reduction="sum"))
    count = (word_ids >= 0).sum()
    torch.testing.assert_close(out.loss.detach(), (sum(fwd) + sum(bwd)) / count / 2)


def test_bad_arguments_are_named():
    model = ELMo(_config())
    with pytest.raises(ValueError, match="char_ids"):
        model(torch.zeros(2, 3, 49, dtype=torch.long))
    with pytest.raises(TypeError, match="char_ids"):
        model(torch.zeros(2, 3, 50))
    with pytest.raises(ValueError, match="char_ids"):
        model(torch.full((2, 3, 50), 262))
    with pytest.raises(TypeError, match="sentences"):
        batch_to_ids(["not", "tokenized"])
    with pytest.raises(ValueError, match="activation"):
        _config(activation="gelu")
    with pytest.raises(ValueError, match="filters"):
        _config(filters=[[60, 4]])
    with pytest.raises(ValueError, match="cell_clip"):
        _config(cell_clip=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        ElmoBiLM(_config())
    bilm = ElmoBiLM(_config(vocab_size=5))
    with pytest.raises(ValueError, match="word_ids"):
        bilm(batch_to_ids(SENTENCES), torch.zeros(3, 5, dtype=torch.long))


def test_models_are_exported():
    assert {"ELMo", "ElmoBiLM", "ElmoConfig"} <= set(fusedlm.models.__all__)


def test_readme_example_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("### ELMo\n", 1)[1].split("\n## ", 1)[0]
    scope = {}
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), "README.md", "exec"), scope)
    assert scope["vectors"].shape == (2, 4, 64) and torch.isfinite(scope["loss"])
