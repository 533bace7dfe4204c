"""cross_entropy, distillation_loss and masked_lm_loss: softmax cross-entropy fused with
its gradient, DistilBERT's soft-target loss the same way, and the masked-LM head
(vocabulary projection + cross-entropy) on labelled rows only.

cross_entropy computes d(loss)/d(logits) in the same pass as the loss, into a new
buffer (nothing the caller holds is written); the backward only scales it by
grad_output. When no gradient is needed (no_grad, or logits that do not require
grad) the forward computes the loss alone.

masked_lm_loss never projects rows whose label is ignore_index. The labelled rows are
gathered inside the op (so torch.compile sees static shapes) and projected
``LOGITS_CHUNK_BYTES`` of logits at a time; each chunk's logits are overwritten by
their gradient, which is folded into d_hidden, d_weight and d_bias before the next
chunk, so the backward only scales those by grad_output. With reduction="none" the
grad_output weighs each row, which sums over rows cannot take afterwards: the forward
then computes the losses only and the backward redoes the chunks with each row's
gradient scaled by its grad_output (a second projection rather than stored logits).
"""
import collections
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import check_index_data, choose, planner
from ..backends.reference import vjp
from ..dtypes import acc_dtype
from . import _validate as check
from ._op import Op
from ._probe import Probe, randn
from ._probe import labels as probe_labels

__all__ = ["cross_entropy", "distillation_loss", "masked_lm_loss"]

REDUCTIONS = ("mean", "sum", "none")
# masked_lm_loss projects this many bytes of logits at a time (at least one row): large
# enough for efficient matrix products, small next to full-vocabulary logits.
LOGITS_CHUNK_BYTES = 32 * 2**20


def _check_labels(labels: Tensor, batch_shape, ignore_index) -> None:
    """labels: int64 of batch_shape; ignore_index an int. (Their values: _check_label_values.)"""
    check.tensor("labels", labels, dtypes=(torch.int64,))
    check.shape("labels", labels, batch_shape)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _label_error(classes: int, ignore_index: int, first: int, where: str = "") -> ValueError:
    return ValueError(f"labels must be class indices in [0, {classes}) or ignore_index "
                      f"({ignore_index}), got {first}{where}")


def _bad_labels(labels: Tensor, classes: int, ignore_index: int) -> Tensor:
    return (labels != ignore_index) & ((labels < 0) | (labels >= classes))


class _Verdict:
    """One call's label check on a GPU, on its way to the host: (whether a label is out of
    range, the first that is), copied without blocking behind ``event``."""

    def __init__(self, labels: Tensor, classes: int, ignore_index: int, op: str, event):
        bad = _bad_labels(labels, classes, ignore_index).flatten()
        first = labels.flatten()[bad.int().argmax()]
        self.found = torch.empty(2, dtype=torch.int64, pin_memory=labels.is_cuda)
        self.found.copy_(torch.stack((bad.any().long(), first)), non_blocking=True)
        self.classes, self.ignore_index, self.op, self.event = classes, ignore_index, op, event
        event.record()

    def raise_if_bad(self) -> None:
        self.event.synchronize()  # (complete already, unless the backlog is full)
        bad, first = self.found.tolist()
        if bad:
            raise _label_error(self.classes, self.ignore_index, first,
                               f" (in the labels of an earlier {self.op} call, checked on the "
                               "device; FUSEDLM_DEBUG=1 checks each call before it runs)")


class _LabelChecks:
    """The range checks of the losses' labels on a GPU, without stalling a step: reading a
    check's result at once would synchronise the host with the device every step. Each
    call's verdict is read by a later call, once its event has completed, and a bad label
    raises there. At most ``BACKLOG`` wait; past that, the oldest is waited for."""

    BACKLOG = 64

    def __init__(self):
        self._pending = collections.deque()

    def raise_found(self) -> None:
        """Raises for the first completed check that found a bad label (dropping it)."""
        while self._pending and self._pending[0].event.query():
            self._pending.popleft().raise_if_bad()

    def add(self, labels: Tensor, classes: int, ignore_index: int, op: str, event=None) -> None:
        self.raise_found()
        if labels.numel() == 0:
            return
        if len(self._pending) >= self.BACKLOG:
            self._pending.popleft().raise_if_bad()
        event = torch.Event(labels.device) if event is None else event
        self._pending.append(_Verdict(labels, classes, ignore_index, op, event))


_LABEL_CHECKS = _LabelChecks()


def _check_label_values(labels: Tensor, classes: int, ignore_index: int, backend: str,
                        op: str) -> None:
    """Each label a class index or ignore_index: checked by the cpu backend's kernels as they
    read them; for other calls, on CPU tensors here, and on a GPU by a later call
    (_LabelChecks), or here with FUSEDLM_DEBUG=1 (fusedlm.backends.check_index_data).
    Unchecked while torch.compile traces or a CUDA graph captures: a bad label's loss is NaN."""
    if check_index_data(labels.device, backend):
        bad = _bad_labels(labels, classes, ignore_index)
        if bad.any():
            raise _label_error(classes, ignore_index, labels[bad].flatten()[0].item())
    elif check_index_data(labels.device, backend, once_a_step=True):
        _LABEL_CHECKS.add(labels, classes, ignore_index, op)


def _check_options(label_smoothing, reduction) -> None:
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    check.choice("reduction", reduction, REDUCTIONS)


# --- cross_entropy -------------------------------------------------------------------------------

@planner("cross_entropy")
def plan_cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                       backend=None):
    check.tensor("logits", logits, min_ndim=1)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have at least one class in its last dimension, got shape {tuple(logits.shape)}")
    _check_options(label_smoothing, reduction)
    device = check.same_device(logits=logits, labels=labels if isinstance(labels, Tensor) else None)
    _check_labels(labels, logits.shape[:-1], ignore_index)
    choice = choose("cross_entropy", device, backend, dtype=logits.dtype)
    _check_label_values(labels, logits.shape[-1], ignore_index, choice.backend, "cross_entropy")
    return choice


def cross_entropy(logits: Tensor, labels: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean",
                  backend: Optional[str] = None) -> Tensor:
    """F.cross_entropy over the last dimension of logits [..., classes] with int64 labels [...].

    The loss is float32 (float64 for float64 logits); a mean over no labelled rows is 0.
    """
    choice = plan_cross_entropy(logits, labels, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, reduction=reduction, backend=backend)
    with_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, _ = CROSS_ENTROPY.call(choice.backend, logits, labels, ignore_index, float(label_smoothing),
                            reduction, with_grad)
    return loss


def _cross_entropy_fake(logits, labels, ignore_index, label_smoothing, reduction, with_grad):
    shape = labels.shape if reduction == "none" else ()
    loss = logits.new_empty(shape, dtype=acc_dtype(logits.dtype))
    return loss, logits.new_empty(logits.shape) if with_grad else None


def cross_entropy_reference(logits, labels, *, ignore_index=-100, label_smoothing=0.0,
                            reduction="mean"):
    """F.cross_entropy over the last dim of logits [..., classes]; float32 or wider.

    Unlike torch, a mean over no labelled rows is 0 rather than NaN.
    """
    logits2 = logits.reshape(-1, logits.shape[-1]).to(acc_dtype(logits.dtype))
    labels1 = labels.reshape(-1)
    losses = F.cross_entropy(logits2, labels1, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, reduction="none")
    if reduction == "none":
        return losses.view(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (labels1 != ignore_index).sum().clamp(min=1)


def _scaled(grad: Tensor, saved: Tensor, reduction: str) -> Tensor:
    """A gradient saved for grad_output 1, scaled by grad_output (one value per row for
    "none"): the reference backend's cross_entropy backward."""
    scale = grad[..., None] if reduction == "none" else grad
    return (saved.to(grad.dtype) * scale).to(saved.dtype)


def _cross_entropy_reference_forward(logits, labels, ignore_index, label_smoothing, reduction,
                                     with_grad):
    def loss(logits):
        return cross_entropy_reference(logits, labels, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction=reduction)
    value = loss(logits)
    grad = vjp(loss, (logits,), (torch.ones_like(value),))[0] if with_grad else None
    return value, grad


def _cross_entropy_composition(logits, labels, ignore_index, label_smoothing, reduction,
                               with_grad):
    """torch's cross_entropy of the logits in float32, as autocast runs it."""
    return cross_entropy_reference(logits, labels, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, reduction=reduction), None


def _cross_entropy_probe(rows, classes):
    def make(g):
        return (randn(g, rows, classes, scale=3.0), probe_labels(g, rows, classes)), {}
    return make


CROSS_ENTROPY = Op(
    "cross_entropy", _cross_entropy_fake,
    reference=cross_entropy_reference,
    reference_kernels=(_cross_entropy_reference_forward, _scaled),
    composition=_cross_entropy_composition,
    probes=(Probe("1000 classes", _cross_entropy_probe(40, 1000)),
            Probe.real("GPT-2 small, 1024 x 50257", _cross_entropy_probe(1024, 50257))),
).differentiable(
    lambda grad, saved_grad, reduction: saved_grad.new_empty(saved_grad.shape), twice=False)


# --- distillation_loss ---------------------------------------------------------------------------

@planner("distillation_loss")
def plan_distillation_loss(student_logits, teacher_logits, *, temperature=1.0, reduction="mean",
                           backend=None):
    check.tensor("student_logits", student_logits, min_ndim=1)
    check.tensor("teacher_logits", teacher_logits, min_ndim=1)
    if student_logits.shape[-1] == 0:
        raise ValueError("student_logits must have at least one class in its last dimension, got "
                         f"shape {tuple(student_logits.shape)}")
    check.shape("teacher_logits", teacher_logits, tuple(student_logits.shape))
    check.same_dtype(student_logits=student_logits, teacher_logits=teacher_logits)
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not 0.0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a positive float, got {temperature!r}")
    check.choice("reduction", reduction, REDUCTIONS)
    device = check.same_device(student_logits=student_logits, teacher_logits=teacher_logits)
    if torch.is_grad_enabled() and teacher_logits.requires_grad:
        raise ValueError("teacher_logits must not require grad: the loss trains the student only "
                         "(pass teacher_logits.detach(), or compute them under torch.no_grad())")
    return choose("distillation_loss", device, backend, dtype=student_logits.dtype)


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, *, temperature: float = 1.0,
                      reduction: str = "mean", backend: Optional[str] = None) -> Tensor:
    """DistilBERT's soft-target loss over the last dimension of logits [..., classes]:
    T² · KL(softmax(teacher_logits / T) ‖ softmax(student_logits / T)) per row (T the
    temperature), reduced over the rows ("mean": their average, as KLDivLoss's
    "batchmean"). The gradient reaches the student only; the softmaxes are never stored.

    The loss is float32 (float64 for float64 logits).
    """
    choice = plan_distillation_loss(student_logits, teacher_logits, temperature=temperature,
                                    reduction=reduction, backend=backend)
    with_grad = torch.is_grad_enabled() and student_logits.requires_grad
    loss, _ = DISTILLATION_LOSS.call(choice.backend, student_logits, teacher_logits, float(temperature),
                                reduction, with_grad)
    return loss


def _distillation_fake(student_logits, teacher_logits, temperature, reduction, with_grad):
    shape = student_logits.shape[:-1] if reduction == "none" else ()
    loss = student_logits.new_empty(shape, dtype=acc_dtype(student_logits.dtype))
    return loss, student_logits.new_empty(student_logits.shape) if with_grad else None


def distillation_loss_reference(student_logits, teacher_logits, *, temperature=1.0,
                                reduction="mean"):
    """T² · KLDivLoss(log_softmax(student / T), softmax(teacher / T)) per row, as
    DistilBERT trains; float32 or wider."""
    acc = acc_dtype(student_logits.dtype)
    log_q = torch.log_softmax(student_logits.to(acc) / temperature, dim=-1)
    p = torch.softmax(teacher_logits.to(acc) / temperature, dim=-1)
    # Probabilities as the target: xlogy makes a class of teacher probability 0 add 0.
    losses = F.kl_div(log_q, p, reduction="none").sum(-1) * temperature ** 2
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / max(losses.numel(), 1)


def _distillation_reference_forward(student_logits, teacher_logits, temperature, reduction,
                                    with_grad):
    def loss(student):
        return distillation_loss_reference(student, teacher_logits, temperature=temperature,
                                           reduction=reduction)
    value = loss(student_logits)
    grad = vjp(loss, (student_logits,), (torch.ones_like(value),))[0] if with_grad else None
    return value, grad


def _distillation_composition(student_logits, teacher_logits, temperature, reduction, with_grad):
    return distillation_loss_reference(student_logits, teacher_logits, temperature=temperature,
                                       reduction=reduction), None


def _distillation_probe(rows, classes):
    def make(g):
        return (randn(g, rows, classes, scale=3.0), randn(g, rows, classes, scale=3.0)), \
            {"temperature": 2.0}
    return make


# The gradient is the saved one scaled by grad_output: cross_entropy's backward.
DISTILLATION_LOSS = Op(
    "distillation_loss", _distillation_fake,
    reference=distillation_loss_reference,
    reference_kernels=(_distillation_reference_forward, None),
    composition=_distillation_composition,
    probes=(Probe("1000 classes", _distillation_probe(40, 1000), constant=(1,)),
            Probe.real("BERT-base, 1024 x 30522", _distillation_probe(1024, 30522), constant=(1,))),
).differentiable(None, twice=False)  # (its backward is cross_entropy's: the saved gradient, scaled)


# --- masked_lm_loss ------------------------------------------------------------------------------

@planner("masked_lm_loss")
def plan_masked_lm_loss(hidden, weight, bias, labels, *, ignore_index=-100, label_smoothing=0.0,
                        reduction="mean", backend=None):
    check.tensor("hidden", hidden, min_ndim=1)
    check.tensor("weight", weight, ndim=2)
    check.tensor("bias", bias, ndim=1, optional=True)
    vocab, width = weight.shape
    if vocab == 0:
        raise ValueError(f"weight must have at least one row (the vocabulary), got shape {tuple(weight.shape)}")
    check.shape("weight", weight, (vocab, hidden.shape[-1]))
    check.shape("bias", bias, (vocab,))
    check.same_dtype(hidden=hidden, weight=weight, bias=bias)
    _check_options(label_smoothing, reduction)
    device = check.same_device(hidden=hidden, weight=weight, bias=bias,
                               labels=labels if isinstance(labels, Tensor) else None)
    _check_labels(labels, hidden.shape[:-1], ignore_index)
    choice = choose("masked_lm_loss", device, backend, dtype=hidden.dtype)
    _check_label_values(labels, vocab, ignore_index, choice.backend, "masked_lm_loss")
    return choice


def masked_lm_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                   ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                   backend: Optional[str] = None) -> Tensor:
    """cross_entropy(hidden @ weight^T + bias, labels), projecting only the labelled rows.

    hidden [..., H], weight [vocab, H] (nn.Linear's layout), bias [vocab] or None, labels
    int64 [...]. The loss is float32 (float64 for float64 inputs).
    """
    choice = plan_masked_lm_loss(hidden, weight, bias, labels, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, reduction=reduction, backend=backend)
    chunk_rows = max(1, LOGITS_CHUNK_BYTES // (weight.shape[0] * hidden.element_size()))
    grad = torch.is_grad_enabled()
    loss, *_ = MASKED_LM_LOSS.call(choice.backend, hidden, weight, bias, labels, ignore_index,
                              float(label_smoothing), reduction, chunk_rows,
                              grad and hidden.requires_grad, grad and weight.requires_grad,
                              grad and bias is not None and bias.requires_grad)
    return loss


def _grads_like(hidden, weight, bias, needs, computed):
    """Fake gradients: real shapes where computed and asked for, else absent."""
    def like(t, need):
        return t.new_empty(t.shape) if computed and need and t is not None else None
    return like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])


def _masked_lm_loss_fake(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction,
                         chunk_rows, *needs):
    shape = labels.shape if reduction == "none" else ()
    loss = hidden.new_empty(shape, dtype=acc_dtype(hidden.dtype))
    return (loss, *_grads_like(hidden, weight, bias, needs, reduction != "none"))


def _masked_lm_loss_fake_backward(grad, hidden, weight, bias, labels, dhidden, dweight, dbias,
                                  ignore_index, label_smoothing, reduction, chunk_rows, *needs):
    return _grads_like(hidden, weight, bias, needs, True)


def masked_lm_loss_reference(hidden, weight, bias, labels, *, ignore_index=-100,
                             label_smoothing=0.0, reduction="mean"):
    """cross_entropy(hidden @ weight^T + bias, labels): the full-vocabulary computation."""
    return cross_entropy_reference(F.linear(hidden, weight, bias), labels,
                                   ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   reduction=reduction)


def _masked_lm_loss_of(labels, ignore_index, label_smoothing, reduction):
    """The reference as a function of (hidden, weight, bias)."""
    return lambda h, w, b: masked_lm_loss_reference(
        h, w, b, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction)


def _masked_lm_loss_reference_forward(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                      reduction, chunk_rows, *needs):
    loss_of = _masked_lm_loss_of(labels, ignore_index, label_smoothing, reduction)
    loss = loss_of(hidden, weight, bias)
    if reduction == "none":  # the backward weighs each row: it computes the gradients
        return loss, None, None, None
    return (loss, *vjp(loss_of, (hidden, weight, bias), (torch.ones_like(loss),), needs))


def _masked_lm_loss_reference_backward(grad, hidden, weight, bias, labels, dhidden, dweight,
                                       dbias, ignore_index, label_smoothing, reduction,
                                       chunk_rows, *needs):
    """Recomputed from the inputs, not scaled from the saved gradients: a differentiable
    function of the inputs, which a double backward takes."""
    loss_of = _masked_lm_loss_of(labels, ignore_index, label_smoothing, reduction)
    return vjp(loss_of, (hidden, weight, bias), (grad,), needs)


def _masked_lm_loss_composition(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                reduction, chunk_rows, *needs):
    """The logits of every row, labelled or not, in the inputs' dtype, then torch's
    cross_entropy in float32: what a model's eager code runs under autocast."""
    return masked_lm_loss_reference(hidden, weight, bias, labels, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, reduction=reduction), \
        None, None, None


def _masked_lm_probe(rows, hidden, vocab):
    def make(g):
        return (randn(g, rows, hidden), randn(g, vocab, hidden, scale=hidden ** -0.5),
                randn(g, vocab), probe_labels(g, rows, vocab, labelled=0.15)), {}
    return make


MASKED_LM_LOSS = Op(
    "masked_lm_loss", _masked_lm_loss_fake,
    reference=masked_lm_loss_reference,
    reference_kernels=(_masked_lm_loss_reference_forward, _masked_lm_loss_reference_backward),
    composition=_masked_lm_loss_composition,
    probes=(Probe("vocab 1000", _masked_lm_probe(60, 64, 1000)),
            Probe.real("BERT-base, 1024 x 768 -> 30522", _masked_lm_probe(1024, 768, 30522))),
).differentiable(_masked_lm_loss_fake_backward)
