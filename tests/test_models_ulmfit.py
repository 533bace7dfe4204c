"""ULMFiT's AWD-LSTM models against a plain float64 implementation written here from fastai's
modules (embedding dropout on the weight matrix, locked dropout, DropConnect on torch's
LSTM, the tied LinearDecoder, concat pooling and LinBnDrop), drawing the same masks under the
same seed; padding against unpadded rows; fastai's state-dict layouts both ways (with
fastai itself where it is installed); the recipe; and what the models take from
transformers."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedlm
from fusedlm.models import (AWDLSTMConfig, AWDLSTMForLanguageModeling,
                            AWDLSTMForSequenceClassification, AWDLSTMModel)
from fusedlm.models.awd_lstm import CLASSIFIER_DROPOUT, concat_pool, dropout_rates
from fusedlm.models.ulmfit import (discriminative_lrs, layer_groups, slanted_triangular,
                                   ulmfit_optimizer, unfreeze_top)
from helpers import backends_for

VOCAB, PAD = 37, 1


def _config(**changes):
    return AWDLSTMConfig(**{"vocab_size": VOCAB, "emb_size": 6, "hidden_size": 10, "n_layers": 3,
                            "pad_token_id": PAD, "num_labels": 3, **changes})


def _ids(batch, seq, generator=None):
    return torch.randint(2, VOCAB, (batch, seq), generator=generator)


def _perturbed(model):
    """The model with every parameter (and batch-norm statistic) drawn anew, larger than
    its init, so that every gate and activation is exercised."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.normal_(0.0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model


# --- the plain reference ---------------------------------------------------------------------------

def _mask(shape, p):
    """fastai's dropout_mask (float32 draws), in float64."""
    if p == 0:
        return torch.ones(shape, dtype=torch.float64)
    return torch.empty(shape, dtype=torch.float32).bernoulli_(1 - p).div_(1 - p).double()


def _reference_encoder(sd, prefix, config, ids, training):
    """fastai's AWD_LSTM over ids [batch, seq] (no padding): the last layer's raw output."""
    p = (lambda name: getattr(config, name)) if training else (lambda name: 0.0)
    weight = sd[f"{prefix}encoder.weight"]
    masked = weight * _mask((weight.shape[0], 1), p("embed_p"))
    x = F.embedding(ids, masked, PAD)
    x = x * _mask((x.shape[0], 1, x.shape[2]), p("input_p"))
    for layer in range(config.n_layers):
        key = f"{prefix}rnns.{layer}."
        raw_w = sd[f"{key}weight_hh_l0_raw"]
        params = {"weight_hh_l0": raw_w * _mask(raw_w.shape, p("weight_p")),
                  **{f"{n}_l0": sd[f"{key}module.{n}_l0"] for n in ("weight_ih", "bias_ih", "bias_hh")}}
        shell = nn.LSTM(x.shape[-1], raw_w.shape[1], batch_first=True, device="meta")
        x, _ = torch.func.functional_call(shell, params, (x,))
        raw = x
        if layer < config.n_layers - 1:
            x = x * _mask((x.shape[0], 1, x.shape[2]), p("hidden_p"))
    return raw


def _reference_lm(sds, config, ids, training=True):
    """(loss, logits of each direction in the text's order) of fastai's language models,
    the encoders' draws first, then the decoders', as the model draws them."""
    directions = ("forward", "backward") if config.directions == "both" else (config.directions,)
    read = [ids if d == "forward" else ids.flip(1) for d in directions]
    raws = [_reference_encoder(sd, "0.", config, r, training) for sd, r in zip(sds, read)]
    losses, logits = [], []
    for sd, r, raw, d in zip(sds, read, raws, directions):
        dropped = raw * _mask((raw.shape[0], 1, raw.shape[2]), config.output_p if training else 0.0)
        scores = dropped @ sd["0.encoder.weight"].t() + sd["1.decoder.bias"]
        loss = F.cross_entropy(scores[:, :-1].reshape(-1, VOCAB), r[:, 1:].reshape(-1))
        if training:
            loss = loss + config.ar_alpha * dropped.pow(2).mean()
            loss = loss + config.tar_beta * (raw[:, 1:] - raw[:, :-1]).pow(2).mean()
        losses.append(loss)
        logits.append(scores if d == "forward" else scores.flip(1))
    return sum(losses) / len(losses), logits


def _as_leaves(sds):
    """Float64 leaf copies of fastai state dicts; the embedding's copies (encoder_dp, the
    decoder's weight) are the one tensor, as in fastai."""
    sds = sds if isinstance(sds, tuple) else (sds,)
    return [{k: v.detach().double().requires_grad_(v.is_floating_point() and "running" not in k)
             for k, v in sd.items()} for sd in sds]


def _grads_as_fastai(model):
    """The model's gradients in fastai's names (a model whose weights are the gradients)."""
    holder = type(model)(model.config)
    holder.load_state_dict({**model.state_dict(),
                            **{n: p.grad for n, p in model.named_parameters()}})
    sds = holder.to_fastai()
    return sds if isinstance(sds, tuple) else (sds,)


COPIES = ("encoder_dp.emb.weight", "1.decoder.weight")


@pytest.mark.parametrize("backend", ["reference", *backends_for("lstm_cell")])
@pytest.mark.parametrize("directions", ["forward", "backward", "both"])
def test_language_model_training_step_matches_the_plain_reference(directions, backend):
    """Every dropout on (the rates raised so that each one acts), the same masks: the loss,
    the logits and every gradient."""
    config = _config(directions=directions, embed_p=0.2, input_p=0.3, hidden_p=0.3,
                     weight_p=0.4, output_p=0.3)
    model = _perturbed(AWDLSTMForLanguageModeling(config)).train()
    ids = _ids(3, 7)
    sds = _as_leaves(model.to_fastai())
    torch.manual_seed(11)
    with fusedlm.use_backend(backend):
        out = model(ids, labels=ids, return_logits=True)
        out.loss.backward()
    torch.manual_seed(11)
    loss, logits = _reference_lm(sds, config, ids)
    loss.backward()
    torch.testing.assert_close(out.loss.double(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits.double(), logits[0], rtol=1e-4, atol=1e-4)
    if directions == "both":
        torch.testing.assert_close(out.backward_logits.double(), logits[1], rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(_grads_as_fastai(model), sds):
        for name, value in ours.items():
            if name.endswith(COPIES):
                continue
            torch.testing.assert_close(value.double(), theirs[name].grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{directions} {name}: {m}")


def _reference_classifier(sd, config, ids, training):
    """fastai's classifier (one direction, no padding): concat pooling, then LinBnDrop blocks."""
    raw = _reference_encoder(sd, "0.module.", config, ids, training)
    x = torch.cat([raw[:, -1], raw.amax(dim=1), raw.mean(dim=1)], dim=-1)
    blocks = 1 + len(config.classifier_hidden)
    ps = [config.output_p] + [config.classifier_p] * len(config.classifier_hidden)
    for j in range(blocks):
        bn = f"1.layers.{j}.0."
        x = F.batch_norm(x, sd[f"{bn}running_mean"].clone(), sd[f"{bn}running_var"].clone(),
                         sd[f"{bn}weight"], sd[f"{bn}bias"], training=training)
        if training:
            x = x * _mask(x.shape, ps[j])
        x = x @ sd[f"1.layers.{j}.2.weight"].t()
        if j < blocks - 1:
            x = torch.relu(x)
    return x, raw


def test_classifier_training_step_matches_the_plain_reference():
    config = _config(**CLASSIFIER_DROPOUT, classifier_hidden=[7, 5])
    model = _perturbed(AWDLSTMForSequenceClassification(config)).train()
    ids, labels = _ids(4, 6), torch.tensor([0, 2, 1, 2])
    (sd,) = _as_leaves(model.to_fastai())
    torch.manual_seed(3)
    out = model(ids, labels=labels)
    out.loss.backward()
    torch.manual_seed(3)
    logits, raw = _reference_classifier(sd, config, ids, training=True)
    loss = (F.cross_entropy(logits, labels) + config.ar_alpha * raw.pow(2).mean()
            + config.tar_beta * (raw[:, 1:] - raw[:, :-1]).pow(2).mean())
    loss.backward()
    torch.testing.assert_close(out.logits.double(), logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss.double(), loss, rtol=1e-5, atol=1e-5)
    (ours,) = _grads_as_fastai(model)
    for name, value in ours.items():
        if not name.endswith(COPIES) and value.is_floating_point() and "running" not in name:
            torch.testing.assert_close(value.double(), sd[name].grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")


# --- padding -----------------------------------------------------------------------------------------

LENGTHS = (7, 3, 5, 1)


def _padded(lengths=LENGTHS, pad_with=PAD):
    rows = [_ids(1, n)[0] for n in lengths]
    ids = torch.full((len(rows), max(lengths)), pad_with)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    return ids, mask, rows


@pytest.mark.parametrize("directions", ["forward", "backward", "both"])
def test_padded_batches_match_each_text_alone(directions):
    config = _config(directions=directions)
    lm = _perturbed(AWDLSTMForLanguageModeling(config)).eval()
    classifier = _perturbed(AWDLSTMForSequenceClassification(config)).eval()
    ids, mask, rows = _padded()
    out = lm(ids, attention_mask=mask, labels=ids, output_hidden_states=True)
    logits = classifier(ids, attention_mask=mask).logits
    losses, counts = [], []
    for b, row in enumerate(rows):
        alone = lm(row[None], labels=row[None], output_hidden_states=True)
        n = len(row)
        torch.testing.assert_close(out.logits[b, :n], alone.logits[0], rtol=1e-5, atol=1e-5)
        for h, h_alone in zip(out.hidden_states, alone.hidden_states):
            torch.testing.assert_close(h[b, :n], h_alone[0], rtol=1e-5, atol=1e-6)
            assert not h[b, n:].any()  # zero at padding
        for s, s_alone in zip(out.state, alone.state):
            for (h, c), (h1, c1) in zip(s, s_alone):  # each text's own last state
                torch.testing.assert_close(h[b], h1[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(c[b], c1[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits[b], classifier(row[None]).logits[0], rtol=1e-5, atol=1e-5)
        if n > 1:
            losses.append(alone.loss * (n - 1))
            counts.append(n - 1)
    torch.testing.assert_close(out.loss, sum(losses) / sum(counts), rtol=1e-5, atol=1e-6)


def test_padding_never_enters_the_training_loss_or_gradients():
    """What the padded positions hold changes nothing, dropout on (the same masks)."""
    config = _config(directions="both")
    model = _perturbed(AWDLSTMForLanguageModeling(config)).train()
    classifier = _perturbed(AWDLSTMForSequenceClassification(config)).train()
    results = []
    for pad_with in (PAD, 5):
        torch.manual_seed(0)
        ids, mask, _ = _padded(pad_with=pad_with)
        torch.manual_seed(1)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss = loss + classifier(ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 0])).loss
        grads = torch.autograd.grad(loss, [*model.parameters(), *classifier.parameters()])
        results.append((loss, grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_concat_pool_over_the_real_tokens_only():
    output = torch.randn(4, 7, 5, dtype=torch.float64)
    lengths = torch.tensor(LENGTHS)
    pooled = concat_pool(output, lengths)
    for b, n in enumerate(LENGTHS):
        real = output[b, :n]
        expected = torch.cat([real[-1], real.amax(0), real.mean(0)])
        torch.testing.assert_close(pooled[b], expected)


# --- fastai's layouts --------------------------------------------------------------------------------

def _fastai_lm_keys(n_layers):
    keys = ["0.encoder.weight", "0.encoder_dp.emb.weight"]
    for layer in range(n_layers):
        keys += [f"0.rnns.{layer}.weight_hh_l0_raw"] + [f"0.rnns.{layer}.module.{n}_l0"
                                                        for n in ("weight_ih", "bias_ih", "bias_hh")]
    return keys + ["1.decoder.weight", "1.decoder.bias"]


def _fastai_classifier_keys(n_layers, ps):
    keys = [k.replace("0.", "0.module.", 1) for k in _fastai_lm_keys(n_layers)[:-2]]
    for j, p in enumerate(ps):
        keys += [f"1.layers.{j}.0.{n}" for n in ("weight", "bias", "running_mean", "running_var",
                                                 "num_batches_tracked")]
        keys.append(f"1.layers.{j}.{2 if p else 1}.weight")
    return keys


def _shape(key, config):
    """The shape of a fastai key's tensor under config."""
    widths = [config.emb_size] + [config.layer_width(i) for i in range(config.n_layers)]
    if "encoder" in key or key == "1.decoder.weight":
        return (config.vocab_size, config.emb_size)
    if key == "1.decoder.bias":
        return (config.vocab_size,)
    if ".rnns." in key:
        layer = int(key.split(".rnns.")[1].split(".")[0])
        hidden = widths[layer + 1]
        if "weight_ih" in key:
            return (4 * hidden, widths[layer])
        return (4 * hidden, hidden) if "weight_hh" in key else (4 * hidden,)
    _, _, block, part, name = key.split(".")  # 1.layers.<block>.<part>.<name>
    dims = [3 * config.emb_size, *config.classifier_hidden, config.num_labels]
    j = int(block)
    if part != "0":  # the linear layer
        return (dims[j + 1], dims[j])
    return () if name == "num_batches_tracked" else (dims[j],)


def _fastai_state(keys, config):
    sd = {k: (torch.tensor(7) if k.endswith("num_batches_tracked") else torch.randn(_shape(k, config)))
          for k in keys}
    embedding = [k for k in keys if k.endswith(COPIES)]
    for k in embedding:  # one tensor in fastai
        sd[k] = sd[keys[0]].clone()
    return sd


def test_fastai_language_model_layout_both_ways():
    config = _config()
    sd = _fastai_state(_fastai_lm_keys(3), config)
    model, report = AWDLSTMForLanguageModeling.from_fastai(sd, config, output_loading_info=True)
    assert report == {"missing_keys": [], "unexpected_keys": []}
    torch.testing.assert_close(model.awd_lstm.lstms[0].rnns[1].weight_hh, sd["0.rnns.1.weight_hh_l0_raw"])
    torch.testing.assert_close(model.decoders[0].bias, sd["1.decoder.bias"])
    back = model.to_fastai()
    assert list(back) == list(sd)  # fastai's order, which its loader of pretrained weights reads by
    for k in sd:
        torch.testing.assert_close(back[k], sd[k])
    # An encoder of its own (fastai's save_encoder) and a {"model": ...} checkpoint load too.
    encoder = {k[2:]: v for k, v in sd.items() if k.startswith("0.")}
    assert AWDLSTMModel.from_fastai(encoder, config).to_fastai().keys() == encoder.keys()
    again = AWDLSTMForLanguageModeling.from_fastai({"model": sd, "opt": {}}, config)
    torch.testing.assert_close(again.decoders[0].bias, sd["1.decoder.bias"])


def test_fastai_files_of_older_releases_with_the_dropped_copy_load():
    config = _config()
    sd = _fastai_state(_fastai_lm_keys(3), config)
    sd["0.rnns.0.module.weight_hh_l0"] = torch.randn(40, 10)  # WeightDropout's copy, unused
    _, report = AWDLSTMForLanguageModeling.from_fastai(sd, config, output_loading_info=True)
    assert report == {"missing_keys": [], "unexpected_keys": []}


def test_fastai_classifier_layout_both_ways_and_the_load_report():
    config = _config(classifier_hidden=[8], classifier_p=0.0)
    keys = _fastai_classifier_keys(3, [config.output_p, 0.0])
    sd = _fastai_state(keys, config)
    model = AWDLSTMForSequenceClassification.from_fastai(sd, config)
    torch.testing.assert_close(model.classifiers[0].layers[1].linear.weight, sd["1.layers.1.1.weight"])
    torch.testing.assert_close(model.classifiers[0].layers[0].batch_norm.running_var,
                               sd["1.layers.0.0.running_var"])
    back = model.to_fastai()
    assert list(back) == keys
    # A language model's state dict into a classifier: the encoder loads, the head is missing.
    lm = _fastai_state(_fastai_lm_keys(3), config)
    with pytest.raises(ValueError, match="missing .*1.layers.0.0.weight.*unexpected .*1.decoder.bias"):
        AWDLSTMForSequenceClassification.from_fastai(lm, config)
    model, report = AWDLSTMForSequenceClassification.from_fastai(lm, config, strict=False,
                                                                 output_loading_info=True)
    assert report["unexpected_keys"] == ["1.decoder.weight", "1.decoder.bias"]
    assert "1.layers.0.2.weight" in report["missing_keys"]
    torch.testing.assert_close(model.awd_lstm.lstms[0].encoder.weight, lm["0.encoder.weight"])


def test_fastai_layout_errors_name_the_key():
    config = _config()
    sd = _fastai_state(_fastai_lm_keys(3), config)
    sd["0.rnns.2.module.weight_ih_l0"] = torch.randn(3, 3)
    with pytest.raises(ValueError, match=r"0\.rnns\.2\.module\.weight_ih_l0 has shape \(3, 3\)"):
        AWDLSTMForLanguageModeling.from_fastai(sd, config)
    with pytest.raises(ValueError, match="no fastai AWD_LSTM"):
        AWDLSTMForLanguageModeling.from_fastai({"foo": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match=r"\(forward, backward\) pair"):
        AWDLSTMForLanguageModeling.from_fastai(sd, _config(directions="both"))


def test_both_directions_convert_as_a_pair():
    config = _config(directions="both")
    pair = (_fastai_state(_fastai_lm_keys(3), config), _fastai_state(_fastai_lm_keys(3), config))
    model = AWDLSTMForLanguageModeling.from_fastai(pair, config)
    torch.testing.assert_close(model.awd_lstm.lstms[1].encoder.weight, pair[1]["0.encoder.weight"])
    back = model.to_fastai()
    assert isinstance(back, tuple) and len(back) == 2
    torch.testing.assert_close(back[1]["1.decoder.bias"], pair[1]["1.decoder.bias"])


def test_matches_fastai_itself():
    """fastai's own modules, where it is installed: the language model's training step
    (the same masks) and the classifier's outputs."""
    pytest.importorskip("fastai", reason="fastai is not installed (an optional baseline)")
    from fastai.text.models.awdlstm import AWD_LSTM
    from fastai.text.models.core import get_language_model, get_text_classifier

    config = _config(embed_p=0.2, input_p=0.3, hidden_p=0.3, weight_p=0.4, output_p=0.3)
    settings = dict(emb_sz=6, n_hid=10, n_layers=3, pad_token=PAD, bidir=False)
    rates = {k: getattr(config, k) for k in ("embed_p", "input_p", "hidden_p", "weight_p", "output_p")}
    theirs = get_language_model(AWD_LSTM, VOCAB, config={**settings, **rates, "tie_weights": True,
                                                         "out_bias": True})
    ours = _perturbed(AWDLSTMForLanguageModeling(config)).train()
    theirs.load_state_dict(ours.to_fastai())
    ids = _ids(3, 8)
    torch.manual_seed(4)
    out = ours(ids, labels=ids, return_logits=True)
    torch.manual_seed(4)
    theirs.reset()
    decoded, raw, dropped = theirs(ids)
    torch.testing.assert_close(out.logits, decoded, rtol=1e-5, atol=1e-5)
    classifier = _perturbed(AWDLSTMForSequenceClassification(config)).eval()
    fastai_classifier = get_text_classifier(AWD_LSTM, VOCAB, 3, config={**settings, **rates}).eval()
    fastai_classifier.load_state_dict(classifier.to_fastai())
    torch.testing.assert_close(classifier(ids).logits, fastai_classifier(ids)[0], rtol=1e-5, atol=1e-5)


# --- the recipe --------------------------------------------------------------------------------------

def test_layer_groups_partition_the_parameters_bottom_up():
    for cls, first in ((AWDLSTMForLanguageModeling, "rnns.0"), (AWDLSTMForSequenceClassification, "encoder")):
        model = cls(_config(directions="both"))
        groups = layer_groups(model)
        names = {id(p): n for n, p in model.named_parameters()}
        flat = [id(p) for g in groups for p in g]
        assert sorted(flat) == sorted(names) and len(set(flat)) == len(flat)
        assert all(first in names[id(p)] for p in groups[0])
        assert len(groups) == (4 if cls is AWDLSTMForLanguageModeling else 5)


def test_discriminative_rates_and_the_optimizer():
    assert discriminative_lrs(1e-2, 3) == pytest.approx([1e-2 / 2.6 ** 2, 1e-2 / 2.6, 1e-2])
    model = AWDLSTMForSequenceClassification(_config())
    optimizer = ulmfit_optimizer(model, lr=1e-2)
    rates = sorted({g["lr"] for g in optimizer.param_groups})
    assert rates == pytest.approx(discriminative_lrs(1e-2, 5))
    assert optimizer.defaults["betas"] == (0.7, 0.99)
    assert all(g["weight_decay"] == 0 for g in optimizer.param_groups if g["params"][0].dim() < 2)


def test_slanted_triangular_schedule():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = slanted_triangular(optimizer, total_steps=100)
    rates = []
    for _ in range(101):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(1 / 32)
    assert rates[10] == pytest.approx(1.0) and max(rates) == rates[10]
    assert rates[100] == pytest.approx(1 / 32)
    assert all(a < b for a, b in zip(rates[:10], rates[1:11]))
    assert all(a > b for a, b in zip(rates[10:100], rates[11:101]))
    with pytest.raises(ValueError, match="total_steps"):
        slanted_triangular(optimizer, total_steps=0)


def test_gradual_unfreezing():
    model = AWDLSTMForSequenceClassification(_config())
    groups = layer_groups(model)
    for stage in range(1, len(groups) + 1):
        unfreeze_top(model, stage)
        trainable = [all(p.requires_grad for p in g) for g in groups]
        assert trainable == [i >= len(groups) - stage for i in range(len(groups))]
    unfreeze_top(model, None)
    assert all(p.requires_grad for p in model.parameters())


# --- training ----------------------------------------------------------------------------------------

def _classification_task(n, generator):
    """Texts of noise words with one of three cue words somewhere; the cue is the label."""
    texts, labels = [], []
    for _ in range(n):
        label = int(torch.randint(3, (), generator=generator))
        length = int(torch.randint(3, 9, (), generator=generator))
        text = torch.randint(10, VOCAB, (length,), generator=generator)
        text[int(torch.randint(length, (), generator=generator))] = 2 + label
        texts.append(text)
        labels.append(label)
    width = max(len(t) for t in texts)
    ids = torch.full((n, width), PAD)
    mask = torch.zeros(n, width, dtype=torch.long)
    for b, t in enumerate(texts):
        ids[b, :len(t)], mask[b, :len(t)] = t, 1
    return ids, mask, torch.tensor(labels)


def test_classifier_learns_a_small_task(one_thread):
    """From scratch, at ULMFiT's discriminative rates and schedule and fastai's classifier
    dropout (its drop_mult of 0.5); every group trains (gradual unfreezing is for an
    encoder that starts pretrained)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    config = _config(**dropout_rates(CLASSIFIER_DROPOUT, 0.5), emb_size=16, hidden_size=24)
    model = AWDLSTMForSequenceClassification(config)
    (ids, mask, labels), test = _classification_task(192, generator), _classification_task(96, generator)
    steps, batch = 200, 32
    optimizer = ulmfit_optimizer(model, lr=3e-2)
    schedule = slanted_triangular(optimizer, steps)
    model.train()
    for step in range(steps):
        part = slice((step * batch) % 192, (step * batch) % 192 + batch)
        model(ids[part], attention_mask=mask[part], labels=labels[part]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    model.eval()
    with torch.no_grad():
        predicted = model(test[0], attention_mask=test[1]).logits.argmax(-1)
    accuracy = (predicted == test[2]).float().mean().item()
    assert accuracy >= 0.9, accuracy


def test_language_model_loss_falls_on_the_embedded_corpus(one_thread):
    from fusedlm.cli import tokenizer as tok
    from fusedlm.cli.corpus import default_corpus
    from fusedlm.cli.registry import pack, token_ids

    documents = default_corpus().documents[:300]
    tokenizer = tok.train("ulmfit", documents, 2000)
    blocks = pack(token_ids(tokenizer, documents), 32, None)[:64]
    torch.manual_seed(0)
    model = AWDLSTMForLanguageModeling(AWDLSTMConfig(
        vocab_size=tokenizer.get_vocab_size(), emb_size=32, hidden_size=64,
        pad_token_id=tok.role_id(tokenizer, "pad")))
    optimizer = ulmfit_optimizer(model, lr=1e-2)
    losses = []
    for step in range(60):
        batch = blocks[(step * 16) % 64:(step * 16) % 64 + 16]
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses[::5]


def test_double_backward_and_torch_func_match_the_reference_backend():
    config = _config(directions="both")
    model = _perturbed(AWDLSTMForLanguageModeling(config)).eval()
    ids = _ids(2, 5)
    params = dict(model.named_parameters())

    def loss_of(p):
        return torch.func.functional_call(model, p, (ids,), {"labels": ids}).loss

    results = []
    for backend in ("cpu", "reference"):
        with fusedlm.use_backend(backend):
            grads = torch.func.grad(loss_of)(params)
            first = torch.autograd.grad(model(ids, labels=ids).loss, list(params.values()),
                                        create_graph=True)
            second = torch.autograd.grad(sum(g.pow(2).sum() for g in first), list(params.values()))
        results.append((grads, second))
    for name in params:
        torch.testing.assert_close(results[0][0][name], results[1][0][name], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_autocast_training_step():
    model = _perturbed(AWDLSTMForLanguageModeling(_config())).train()
    ids = _ids(3, 6)
    torch.manual_seed(2)
    exact = model(ids, labels=ids).loss
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids, labels=ids).loss
    low.backward()
    assert torch.isfinite(low) and abs(low.item() - exact.item()) < 0.05 * abs(exact.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# --- generate ----------------------------------------------------------------------------------------

def test_greedy_generation_continues_with_the_most_probable_token():
    model = _perturbed(AWDLSTMForLanguageModeling(_config())).eval()
    prompt = _ids(1, 4)
    out = model.generate(prompt, max_new_tokens=5)
    text = prompt
    for _ in range(5):
        following = model(text).logits[0, -1].argmax()
        text = torch.cat([text, following.view(1, 1)], dim=1)
    assert torch.equal(out, text)


def test_generation_of_padded_prompts_matches_each_alone_and_stops_at_eos():
    model = _perturbed(AWDLSTMForLanguageModeling(_config(directions="both"))).eval()
    ids, mask, rows = _padded(lengths=(4, 2, 3))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    for b, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=3)[0]
        assert torch.equal(out[b, :len(alone)], alone)
        assert not out[b, len(alone):].any()
    first = int(model.generate(rows[0][None], max_new_tokens=1)[0, -1])
    stopped = model.generate(rows[0][None], max_new_tokens=4, eos_token_id=first, pad_token_id=0)
    assert stopped[0, len(rows[0])] == first and not stopped[0, len(rows[0]) + 1:].any()
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, top_k=5,
                             top_p=0.9, temperature=0.7)
    assert sampled.shape == (3, 7)
    with pytest.raises(ValueError, match="forward language model"):
        AWDLSTMForLanguageModeling(_config(directions="backward")).generate(ids)


# --- transformers' parts, and bad input -------------------------------------------------------------

@pytest.mark.parametrize("cls", [AWDLSTMModel, AWDLSTMForLanguageModeling, AWDLSTMForSequenceClassification])
def test_save_and_load_pretrained(cls, tmp_path):
    model = _perturbed(cls(_config(directions="both"))).eval()
    model.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path).eval()
    ids = _ids(2, 5)
    a, b = model(ids), loaded(ids)
    torch.testing.assert_close(a[0], b[0])
    assert loaded.config.directions == "both"


def test_an_lm_folder_gives_the_classifier_its_encoder(tmp_path):
    lm = _perturbed(AWDLSTMForLanguageModeling(_config()))
    lm.save_pretrained(tmp_path)
    classifier, info = AWDLSTMForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    torch.testing.assert_close(classifier.awd_lstm.lstms[0].rnns[2].weight_hh,
                               lm.awd_lstm.lstms[0].rnns[2].weight_hh)
    assert all(k.startswith("classifiers.") for k in info["missing_keys"])
    assert info["unexpected_keys"] and all(k.startswith("decoders.") for k in info["unexpected_keys"])


def test_outputs_index_like_transformers():
    model = AWDLSTMForSequenceClassification(_config()).eval()
    ids = _ids(2, 4)
    out = model(ids, labels=torch.tensor([0, 1]))
    assert out[0] is out.loss and out["logits"] is out.logits and out.logits.shape == (2, 3)
    encoder = AWDLSTMModel(_config(directions="both")).eval()
    hidden = encoder(ids, output_hidden_states=True)
    assert hidden.last_hidden_state.shape == (2, 4, 12) and len(hidden.hidden_states) == 3
    assert hidden.hidden_states[0].shape == (2, 4, 20)


@pytest.mark.parametrize("field, value, message", [
    ("embed_p", 1.0, "embed_p must be in"), ("weight_p", -0.1, "weight_p must be in"),
    ("directions", "sideways", "directions must be one of"), ("n_layers", 0, "n_layers must be"),
    ("pad_token_id", VOCAB, "pad_token_id must be"), ("classifier_hidden", [0], "classifier_hidden"),
    ("ar_alpha", -1.0, "ar_alpha must not be negative")])
def test_bad_config_values_are_rejected_naming_them(field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(**{field: value})


def test_bad_arguments_are_named():
    model = AWDLSTMForLanguageModeling(_config())
    ids = _ids(2, 4)
    with pytest.raises(ValueError, match="input_ids must be an int64"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 37\)"):
        model(ids + VOCAB)
    with pytest.raises(ValueError, match="pad on the right"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="at least one token"):
        model(ids, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        model(ids, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(ids, labels=ids[:, :2])
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\)"):
        AWDLSTMForSequenceClassification(_config())(ids, labels=torch.tensor([1]))
    with pytest.raises(ValueError, match="state must hold one entry per direction"):
        model(ids, state=((), ()))


def test_state_continues_a_text():
    """Reading a text in two parts, the second from the first's state, is reading it whole."""
    model = _perturbed(AWDLSTMForLanguageModeling(_config())).eval()
    ids = _ids(2, 8)
    whole = model(ids).logits
    first = model(ids[:, :5])
    second = model(ids[:, 5:], state=first.state).logits
    torch.testing.assert_close(torch.cat([first.logits, second], dim=1), whole, rtol=1e-5, atol=1e-6)


def test_regression_head_with_one_label():
    model = AWDLSTMForSequenceClassification(_config(num_labels=1, directions="both"))
    out = model(_ids(3, 4), labels=torch.tensor([0.5, -1.0, 2.0]))
    assert out.logits.shape == (3, 1) and torch.isfinite(out.loss)
    out.loss.backward()


def test_models_are_exported():
    assert all(hasattr(fusedlm.models, name) for name in (
        "AWDLSTMConfig", "AWDLSTMModel", "AWDLSTMForLanguageModeling",
        "AWDLSTMForSequenceClassification"))
    assert math.isclose(AWDLSTMConfig().output_p, 0.1) and AWDLSTMConfig().emb_size == 400


def test_resize_token_embeddings_starts_new_words_at_the_mean():
    model = _perturbed(AWDLSTMForLanguageModeling(_config(directions="both"))).eval()
    ids = _ids(2, 5)
    before = model(ids).logits
    model.resize_token_embeddings(VOCAB + 4)
    assert model.config.vocab_size == VOCAB + 4
    for lstm, decoder in zip(model.awd_lstm.lstms, model.decoders):
        weight = lstm.encoder.weight
        torch.testing.assert_close(weight[VOCAB:], weight[:VOCAB].mean(0).expand(4, -1))
        torch.testing.assert_close(decoder.bias[VOCAB:], decoder.bias[:VOCAB].mean().expand(4))
    after = model(ids).logits
    torch.testing.assert_close(after[..., :VOCAB], before)
    model(_ids(2, 5) + 2, labels=ids).loss.backward()  # the new ids are read and trained


def test_add_words_extends_the_word_vocabulary():
    from fusedlm.cli import tokenizer as tok

    tokenizer = tok.train("ulmfit", ["the cat sat on the mat", "the dog"], 100)
    size = tokenizer.get_vocab_size()
    extended, added = tok.add_words(tokenizer, ["A zebra and a Zebra", "one yak", "and zebra"])
    assert added == ["zebra", "a", "and"]  # seen twice at least, the most frequent first
    assert extended.get_vocab_size() == size + 3 and extended.token_to_id("zebra") == size
    assert extended.encode("zebra cat").ids == [extended.token_to_id("[CLS]"), size,
                                               tokenizer.token_to_id("cat")]


def test_readme_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("### ULMFiT\n", 1)[1].split("\n## ", 1)[0]
    scope = {}
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), "README.md", "exec"), scope)
    assert all(p.grad is None for p in scope["classifier"].awd_lstm.parameters())  # frozen
    assert all(p.grad is not None for p in scope["classifier"].classifiers.parameters())
