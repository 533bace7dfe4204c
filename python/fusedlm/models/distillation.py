"""Distillation as DistilBERT trains it: a student with half the teacher's layers, started
from the teacher's own weights, learns the teacher's soft predictions.

``student_from_teacher`` builds the student of a masked-LM teacher: for BERT a
DistilBertForMaskedLM, for RoBERTa a RobertaForMaskedLM with fewer layers (DistilRoBERTa),
its layers copied from teacher layers spread evenly from the first to the last (0, 2, 4,
7, 9, 11 for 6 of 12, DistilBERT's choice), and its embeddings and masked-LM head copied
whole. BERT's token type embedding, which DistilBERT lacks, is the same vector at every
position of a one-segment input: it is folded into the position embeddings, so that the
student starts as the teacher's chosen layers exactly.

``Distiller`` is the training module: its forward returns DistilBERT's loss,
alpha_ce * soft-target loss + alpha_mlm * masked-LM loss + alpha_cos * cosine loss, and
each term. The soft-target loss is fusedlm.ops.distillation_loss (no softmax stored); the
teacher runs in eval mode without gradients.
"""
from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from .masking import IGNORE_INDEX

# A BERT layer's parameters under DistilBERT's names.
_BERT_LAYER_TO_DISTILBERT = {
    "attention.self.query": "attention.q_lin", "attention.self.key": "attention.k_lin",
    "attention.self.value": "attention.v_lin", "attention.output.dense": "attention.out_lin",
    "attention.output.LayerNorm": "sa_layer_norm", "intermediate.dense": "ffn.lin1",
    "output.dense": "ffn.lin2", "output.LayerNorm": "output_layer_norm"}
_BERT_HEAD_TO_DISTILBERT = {"cls.predictions.transform.dense": "vocab_transform",
                            "cls.predictions.transform.LayerNorm": "vocab_layer_norm"}


def chosen_layers(teacher_layers: int, layers: int) -> list:
    """The teacher layers the student's copy, spread evenly from the first to the last."""
    if not 1 <= layers <= teacher_layers:
        raise ValueError(f"layers must be in [1, {teacher_layers}] (the teacher's), got {layers}")
    if layers == 1:
        return [0]
    return [round(i * (teacher_layers - 1) / (layers - 1)) for i in range(layers)]


def student_from_teacher(teacher: nn.Module, layers: int) -> nn.Module:
    """A masked-LM student of ``layers`` layers initialised from ``teacher`` (a
    BertForMaskedLM or RobertaForMaskedLM, fusedlm's or transformers')."""
    model_type = teacher.config.model_type
    if model_type == "bert":
        return _distilbert_from_bert(teacher, layers)
    if model_type == "roberta":
        return _smaller_roberta(teacher, layers)
    raise ValueError(f"teacher must be a BERT or RoBERTa masked-LM model, got a {model_type!r} one")


def _distilbert_from_bert(teacher: nn.Module, layers: int) -> nn.Module:
    from transformers import DistilBertConfig

    from .distilbert import DistilBertForMaskedLM

    c = teacher.config
    if c.hidden_act not in ("gelu", "relu"):
        raise ValueError(f"DistilBERT's activation is gelu or relu; the teacher's is {c.hidden_act!r}")
    config = DistilBertConfig(
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
        sinusoidal_pos_embds=False, n_layers=layers, n_heads=c.num_attention_heads, dim=c.hidden_size,
        hidden_dim=c.intermediate_size, dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob, activation=c.hidden_act,
        initializer_range=c.initializer_range, pad_token_id=c.pad_token_id)
    source = teacher.state_dict()
    state = {}
    for name in ("word_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias"):
        state[f"distilbert.embeddings.{name}"] = source[f"bert.embeddings.{name}"]
    state["distilbert.embeddings.position_embeddings.weight"] = (
        source["bert.embeddings.position_embeddings.weight"]
        + source["bert.embeddings.token_type_embeddings.weight"][0])
    for i, t in enumerate(chosen_layers(c.num_hidden_layers, layers)):
        for bert_name, distil_name in _BERT_LAYER_TO_DISTILBERT.items():
            for p in ("weight", "bias"):
                state[f"distilbert.transformer.layer.{i}.{distil_name}.{p}"] = \
                    source[f"bert.encoder.layer.{t}.{bert_name}.{p}"]
    for bert_name, distil_name in _BERT_HEAD_TO_DISTILBERT.items():
        for p in ("weight", "bias"):
            state[f"{distil_name}.{p}"] = source[f"{bert_name}.{p}"]
    # The decoder: the word embeddings (tied, as in both models) and cls.predictions.bias.
    state["vocab_projector.weight"] = source.get("cls.predictions.decoder.weight",
                                                 source["bert.embeddings.word_embeddings.weight"])
    state["vocab_projector.bias"] = source["cls.predictions.bias"]
    student = DistilBertForMaskedLM(config)
    _load_all(student, state)
    return student


def _smaller_roberta(teacher: nn.Module, layers: int) -> nn.Module:
    from transformers import RobertaConfig

    from .roberta import RobertaForMaskedLM

    config = RobertaConfig.from_dict({**teacher.config.to_dict(), "num_hidden_layers": layers})
    chosen = chosen_layers(teacher.config.num_hidden_layers, layers)
    state = {}
    prefix = "roberta.encoder.layer."
    for key, value in teacher.state_dict().items():
        if not key.startswith(prefix):
            state[key] = value
            continue
        index, rest = key[len(prefix):].split(".", 1)
        for i, t in enumerate(chosen):
            if int(index) == t:
                state[f"{prefix}{i}.{rest}"] = value
    student = RobertaForMaskedLM(config)
    _load_all(student, state)
    return student


def _load_all(model: nn.Module, state: dict) -> None:
    """Loads ``state``, every parameter of ``model`` from it (tied weights once)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"the student's weights do not match the teacher's: missing {missing}, "
                           f"unexpected {unexpected}")


class Distiller(nn.Module):
    """The student and the frozen teacher, whose forward is DistilBERT's training loss.

    forward(input_ids, labels, attention_mask=None) -> (loss, {"loss_ce", "loss_mlm",
    "loss_cos"}): the soft-target loss over every real token (DistilBERT's default),
    the masked-LM loss over the labelled ones, and 1 - cosine similarity of the two
    models' last hidden states over every real token (a mean, as CosineEmbeddingLoss).
    ``save_pretrained`` saves the student.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, *, temperature: float = 2.0,
                 alpha_ce: float = 5.0, alpha_mlm: float = 2.0, alpha_cos: float = 1.0):
        super().__init__()
        if student.config.vocab_size != teacher.config.vocab_size:
            raise ValueError(f"the student's vocabulary ({student.config.vocab_size}) must be the "
                             f"teacher's ({teacher.config.vocab_size})")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        self.student, self.teacher = student, teacher
        self.teacher.requires_grad_(False)
        self.temperature = temperature
        self.alphas = {"loss_ce": alpha_ce, "loss_mlm": alpha_mlm, "loss_cos": alpha_cos}
        self.train()

    def train(self, mode: bool = True) -> "Distiller":
        super().train(mode)
        self.teacher.eval()  # its dropout stays off
        return self

    def forward(self, input_ids: Tensor, labels: Tensor, attention_mask: Optional[Tensor] = None):
        with torch.no_grad():
            t = self.teacher(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        s = self.student(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.bool())
        s_logits, t_logits = s.logits[real], t.logits[real].to(s.logits.dtype)
        terms = {
            "loss_ce": ops.distillation_loss(s_logits, t_logits, temperature=self.temperature),
            "loss_mlm": ops.cross_entropy(s.logits, labels, ignore_index=IGNORE_INDEX),
            "loss_cos": (1 - nn.functional.cosine_similarity(
                s.hidden_states[-1][real].float(), t.hidden_states[-1][real].float(), dim=-1)).mean()}
        loss = sum(self.alphas[name] * value for name, value in terms.items())
        return loss, {name: value.detach() for name, value in terms.items()}

    @property
    def config(self):
        """The student's: the model being trained."""
        return self.student.config

    def save_pretrained(self, directory, **kwargs) -> None:
        self.student.save_pretrained(directory, **kwargs)
