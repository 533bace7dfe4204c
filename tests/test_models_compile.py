"""Whole models under torch.compile: the compiled loss and every parameter's gradient equal
eager's on the same weights, and where the graph must be whole (fullgraph=True) it is.

GPT traces to one graph as it is. BERT and ELECTRA with padding pack their tokens
(ops.unpad) and select labelled rows, whose sizes are data: torch.compile traces them
with unbacked sizes when ``capture_dynamic_output_shape_ops`` is on (one graph), and
otherwise breaks the graph there and runs those few ops eagerly. Most cases use the
aot_eager backend (dynamo, AOTAutograd and the ops' fake impls, without code generation,
which would take minutes on two cores); the smallest model also runs through inductor.
"""
import copy
import re

import pytest
import torch
import torch._dynamo

from models_helpers import MASK, SPECIALS, assert_rel, parity_batch
from fusedlm.models import BertForMaskedLM, ElectraForJointPreTraining, GPT2LMHeadModel, mask_tokens

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
LENGTHS = (12, 9, 5)  # padding in two rows: the packed path runs
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=16, **NO_DROPOUT)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no graphs or counters left by another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gpt():
    return GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_positions=48, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, eos_token_id=1, pad_token_id=0))


def _bert_batch():
    batch = parity_batch(VOCAB, LENGTHS)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


def _electra_batch():
    batch = parity_batch(VOCAB, LENGTHS)
    ids, labels = mask_tokens(batch["input_ids"], mask_token_id=MASK, vocab_size=VOCAB,
                              special_token_ids=SPECIALS, attention_mask=batch["attention_mask"],
                              probability=0.4)
    return {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": labels}


def _loss_and_grads(run, model, batch, seed):
    """run(**batch)'s loss and the gradients of model's parameters (run: model or its
    compiled wrapper)."""
    torch.manual_seed(seed)  # ELECTRA samples its replacements: both sides draw the same
    model.zero_grad(set_to_none=True)
    loss = run(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_compiled_matches_eager(model, make_batch, backend="aot_eager", fullgraph=True):
    """torch.compile of a copy of model (training mode, dropout off) gives eager's loss and
    gradients on two batches of make_batch() (new ids and labels, the same shapes)."""
    model.train()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend=backend, fullgraph=fullgraph)
    for attempt in range(2):
        batch = make_batch()
        seed = int(torch.randint(1 << 30, ()))
        loss, grads = _loss_and_grads(model, model, batch, seed)
        compiled_loss, compiled_grads = _loss_and_grads(compiled, twin, batch, seed)
        assert_rel(compiled_loss, loss, f"loss (batch {attempt})")
        assert compiled_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert grad is not None and compiled_grads[name] is not None, f"{name}: no gradient"
            assert_rel(compiled_grads[name], grad, f"grad {name} (batch {attempt})")


def _gpt_batch(batch=3, seq=17):
    ids = torch.randint(2, 101, (batch, seq))
    return {"input_ids": ids, "labels": ids.masked_fill(torch.rand(ids.shape) < 0.2, -100)}


def test_gpt_compiles_to_one_graph_with_eager_loss_and_gradients():
    assert_compiled_matches_eager(_gpt(), _gpt_batch)


def test_gpt_compiles_with_inductor():
    assert_compiled_matches_eager(_gpt(), lambda: _gpt_batch(2, 9), backend="inductor")


def test_bert_with_padding_is_one_graph_when_dynamic_output_shapes_are_captured():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert_compiled_matches_eager(BertForMaskedLM(transformers.BertConfig(**ENCODER)), _bert_batch)


def test_bert_with_padding_breaks_only_at_data_dependent_sizes_by_default():
    model = BertForMaskedLM(transformers.BertConfig(**ENCODER)).train()
    explained = torch._dynamo.explain(model)(**_bert_batch())
    # ops.unpad before the first layer, and the selection (nonzero) of the masked-LM
    # head's labelled rows: nothing else stops the trace.
    reasons = [r.reason for r in explained.break_reasons]
    assert reasons and all(r.startswith("Dynamic shape operator") for r in reasons), reasons
    assert {re.search(r"Operator `([\w.]+)`", r).group(1) for r in reasons} == {
        "fusedlm.unpad.default", "aten.nonzero.default"}, reasons
    torch._dynamo.reset()
    assert_compiled_matches_eager(model, _bert_batch, fullgraph=False)


def test_electra_pretraining_is_one_graph_when_dynamic_output_shapes_are_captured():
    model = ElectraForJointPreTraining(transformers.ElectraConfig(embedding_size=24, **ENCODER))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert_compiled_matches_eager(model, _electra_batch)


def test_generate_of_a_compiled_gpt_equals_eager():
    """model.compile() compiles the forward that generate calls at every step (the prompt,
    then one token against the KV cache): the same tokens as eager, with and without
    left padding, greedy and sampled."""
    model = _gpt().eval()
    ids = torch.randint(2, 101, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0

    def generate(**kwargs):
        torch.manual_seed(3)
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)

    expected_greedy, expected_sampled = generate(do_sample=False), generate(do_sample=True, top_k=20)
    model.compile(backend="aot_eager")
    assert torch.equal(generate(do_sample=False), expected_greedy)
    assert torch.equal(generate(do_sample=True, top_k=20), expected_sampled)
