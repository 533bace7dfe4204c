"""fusedlm.models.distillation: the student a teacher starts, and DistilBERT's loss."""
import pytest
import torch
import transformers

from fusedlm.models import BertForMaskedLM, Distiller, RobertaForMaskedLM, student_from_teacher
from fusedlm.models.distillation import chosen_layers


def _bert_config(layers=4, **extra):
    options = dict(vocab_size=120, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**options, **extra})


def test_layers_are_spread_from_the_first_to_the_last():
    assert chosen_layers(12, 6) == [0, 2, 4, 7, 9, 11]  # DistilBERT's choice
    assert chosen_layers(4, 2) == [0, 3] and chosen_layers(4, 4) == [0, 1, 2, 3]
    assert chosen_layers(5, 1) == [0]
    with pytest.raises(ValueError, match="layers"):
        chosen_layers(4, 5)


@pytest.mark.parametrize("teacher_class", [BertForMaskedLM, transformers.BertForMaskedLM])
def test_a_student_as_deep_as_its_teacher_is_the_teacher(teacher_class):
    # Every tensor copied, BERT's token type embedding folded into the positions: the same
    # logits on one-segment inputs, from a DistilBERT transformers loads.
    torch.manual_seed(0)
    teacher = teacher_class(_bert_config()).eval()
    student = student_from_teacher(teacher, 4).eval()
    assert isinstance(student, transformers.PreTrainedModel) and student.config.model_type == "distilbert"
    ids = torch.randint(3, 120, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected = teacher(ids, attention_mask=mask).logits
        got = student(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=2e-5)


def test_a_shallower_student_takes_the_chosen_layers(tmp_path):
    torch.manual_seed(0)
    teacher = BertForMaskedLM(_bert_config())
    student = student_from_teacher(teacher, 2)
    source = teacher.state_dict()
    for i, t in enumerate([0, 3]):
        layer = student.distilbert.transformer.layer[i]
        assert torch.equal(layer.attention.q_lin.weight, source[f"bert.encoder.layer.{t}.attention.self.query.weight"])
        assert torch.equal(layer.ffn.lin2.bias, source[f"bert.encoder.layer.{t}.output.dense.bias"])
    student.save_pretrained(tmp_path)
    loaded = transformers.DistilBertForMaskedLM.from_pretrained(tmp_path)
    assert loaded.config.n_layers == 2 and loaded.config.dim == 32


def test_a_roberta_teacher_gives_a_smaller_roberta():
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=120, hidden_size=32, num_hidden_layers=4,
                                        num_attention_heads=2, intermediate_size=64,
                                        max_position_embeddings=42, pad_token_id=1)
    teacher = RobertaForMaskedLM(config).eval()
    student = student_from_teacher(teacher, 4).eval()
    ids = torch.randint(3, 120, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits)
    smaller = student_from_teacher(teacher, 3)
    assert isinstance(smaller, RobertaForMaskedLM) and smaller.config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="teacher must be a BERT or RoBERTa"):
        student_from_teacher(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1)), 1)


def test_distillers_loss_is_distilberts_formula():
    # The same loss written in plain PyTorch: forward and the student's gradients.
    torch.manual_seed(0)
    teacher = BertForMaskedLM(_bert_config()).eval()
    student = student_from_teacher(teacher, 2)
    distiller = Distiller(student, teacher, temperature=3.0, alpha_ce=5.0, alpha_mlm=2.0, alpha_cos=1.0)
    ids = torch.randint(3, 120, (3, 11))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    labels = torch.where((torch.rand(ids.shape) < 0.3) & mask.bool(), ids, -100)
    loss, terms = distiller(ids, labels, attention_mask=mask)
    got = torch.autograd.grad(loss, list(student.parameters()))

    with torch.no_grad():
        t = teacher(ids, attention_mask=mask, output_hidden_states=True)
    s = student(ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()
    ce = torch.nn.KLDivLoss(reduction="batchmean")(
        torch.log_softmax(s.logits[real] / 3.0, -1), torch.softmax(t.logits[real] / 3.0, -1)) * 9.0
    mlm = torch.nn.functional.cross_entropy(s.logits.view(-1, 120), labels.view(-1))
    cos = torch.nn.CosineEmbeddingLoss()(s.hidden_states[-1][real], t.hidden_states[-1][real],
                                         torch.ones(int(real.sum())))
    expected = 5.0 * ce + 2.0 * mlm + 1.0 * cos
    want = torch.autograd.grad(expected, list(student.parameters()))
    for name, value in (("loss_ce", ce), ("loss_mlm", mlm), ("loss_cos", cos)):
        torch.testing.assert_close(terms[name], value.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())


def test_the_teacher_stays_in_eval_mode():
    teacher = BertForMaskedLM(_bert_config(hidden_dropout_prob=0.5))
    distiller = Distiller(student_from_teacher(teacher, 2), teacher)
    distiller.train()
    assert distiller.student.training and not teacher.training
    with pytest.raises(ValueError, match="temperature"):
        Distiller(distiller.student, teacher, temperature=0.0)
