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
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import check_index_data, choose, planner
from ..backends.probes import Probe, randn
from ..backends.probes import labels as probe_labels
from ..backends.reference import vjp
from . import _validate as check
from ._op import Op, kernels_serve
from .reference import acc_dtype

__all__ = ["cross_entropy", "distillation_loss", "masked_lm_loss"]

REDUCTIONS = ("mean", "sum", "none")
# masked_lm_loss projects this many bytes of logits at a time (at least one row): large
# enough for efficient matrix products, small next to full-vocabulary logits.
LOGITS_CHUNK_BYTES = 32 * 2**20


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_labels(labels: Tensor, batch_shape, classes: int, ignore_index) -> None:
    """labels: int64 of batch_shape, each a class index or ignore_index.

    The range check reads the labels, on every device (fusedlm.backends.check_index_data
    says when not).
    """
    check.tensor("labels", labels, dtypes=(torch.int64,))
    check.shape("labels", labels, batch_shape)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not check_index_data(labels.device, once_a_step=True):
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= classes))
    if bad.any():
        first = labels[bad].flatten()[0].item()
        raise ValueError(
            f"labels must be class indices in [0, {classes}) or ignore_index ({ignore_index}), got {first}"
        )


def _check_options(label_smoothing, reduction) -> None:
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    check.choice("reduction", reduction, REDUCTIONS)


def _wants_grad(*tensors: Optional[Tensor]) -> list[bool]:
    enabled = torch.is_grad_enabled()
    return [enabled and t is not None and t.requires_grad for t in tensors]


# --- cross_entropy -------------------------------------------------------------------------------

@planner("cross_entropy")
def plan_cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                       backend=None):
    check.tensor("logits", logits, min_ndim=1)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have at least one class in its last dimension, got shape {tuple(logits.shape)}")
    _check_options(label_smoothing, reduction)
    device = check.same_device(logits=logits, labels=labels if isinstance(labels, Tensor) else None)
    _check_labels(labels, logits.shape[:-1], logits.shape[-1], ignore_index)
    return choose("cross_entropy", device, backend, dtype=logits.dtype)


def cross_entropy(logits: Tensor, labels: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean",
                  backend: Optional[str] = None) -> Tensor:
    """F.cross_entropy over the last dimension of logits [..., classes] with int64 labels [...].

    The loss is float32 (float64 for float64 logits); a mean over no labelled rows is 0.
    """
    choice = plan_cross_entropy(logits, labels, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, reduction=reduction, backend=backend)
    (with_grad,) = _wants_grad(logits)
    loss, _ = CROSS_ENTROPY(choice.backend, logits, labels, ignore_index, float(label_smoothing),
                            reduction, with_grad)
    return loss


def _non_differentiable(ctx, *outputs):
    """Marks the gradient outputs as such. Without set_materialize_grads(False), autograd
    would hand the backward a zero tensor for each of them: a transient copy of every
    gradient buffer. The backward then also sees None for an unused loss."""
    ctx.mark_non_differentiable(*outputs)
    ctx.set_materialize_grads(False)


def _cross_entropy_fake(logits, labels, ignore_index, label_smoothing, reduction, with_grad):
    shape = labels.shape if reduction == "none" else ()
    loss = logits.new_empty(shape, dtype=_acc_dtype(logits.dtype))
    return loss, logits.new_empty(logits.shape) if with_grad else None


def _saved_grad_setup(ctx, inputs, output):
    """cross_entropy's and distillation_loss's: both take (..., reduction, with_grad) and
    return (loss, the gradient for grad_output 1), which the backward scales."""
    ctx.reduction = inputs[-2]
    ctx.save_for_backward(output[1])
    _non_differentiable(ctx, output[1])


def _unit_grad(grad: Tensor, reduction: str) -> bool:
    """Whether a backward may hand out its saved gradients unscaled: grad_output is exactly 1
    (loss.backward()), in eager mode, on the CPU (reading it elsewhere would synchronise).

    The saved gradients then become the inputs' gradients without a copy, the largest
    saving of peak memory these ops have. It is safe: without retain_graph, autograd has
    released the saved tensors before the gradients are accumulated, so nothing else holds
    them; with retain_graph, .grad accumulation copies them, and an in-place change of a
    returned gradient bumps its version, so a second backward raises instead of using it.
    Never where the gradient is to be differentiated again (create_graph=True): the saved
    gradients carry no graph; nor for a batched gradient (fusedlm.ops._op.kernels_serve).
    """
    # A traced gradient (a fake or functional tensor, which torch 2.11 traces the backward
    # with outside is_compiling()) has no value to read: only a plain tensor is looked at.
    return (reduction != "none" and not torch.compiler.is_compiling() and type(grad) is Tensor
            and grad.device.type == "cpu" and kernels_serve((grad,)) and grad.item() == 1.0)


def _cross_entropy_grad(ctx, grad, _grad_of_grad):
    if grad is None:
        return ()
    (saved_grad,) = ctx.saved_tensors
    if _unit_grad(grad, ctx.reduction):
        return (saved_grad,)
    return (CROSS_ENTROPY.backward(ctx, grad, saved_grad, ctx.reduction),)


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


def _cross_entropy_probe(rows, classes):
    def make(g):
        return (randn(g, rows, classes, scale=3.0), probe_labels(g, rows, classes)), {}
    return make


CROSS_ENTROPY = Op(
    "cross_entropy",
    "(Tensor logits, Tensor labels, SymInt ignore_index, float label_smoothing, str reduction, "
    "bool with_grad) -> (Tensor, Tensor)", _cross_entropy_fake,
    reference=cross_entropy_reference,
    reference_kernels=(_cross_entropy_reference_forward, _scaled),
    probes=(Probe("1000 classes", _cross_entropy_probe(40, 1000)),
            Probe.real("GPT-2 small, 1024 x 50257", _cross_entropy_probe(1024, 50257))),
).differentiable(
    "(Tensor grad, Tensor saved_grad, str reduction) -> Tensor",
    lambda grad, saved_grad, reduction: saved_grad.new_empty(saved_grad.shape),
    _saved_grad_setup, _cross_entropy_grad, twice=False)


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
    (with_grad,) = _wants_grad(student_logits)
    loss, _ = DISTILLATION_LOSS(choice.backend, student_logits, teacher_logits, float(temperature),
                                reduction, with_grad)
    return loss


def _distillation_fake(student_logits, teacher_logits, temperature, reduction, with_grad):
    shape = student_logits.shape[:-1] if reduction == "none" else ()
    loss = student_logits.new_empty(shape, dtype=_acc_dtype(student_logits.dtype))
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


def _distillation_probe(rows, classes):
    def make(g):
        return (randn(g, rows, classes, scale=3.0), randn(g, rows, classes, scale=3.0)), \
            {"temperature": 2.0}
    return make


# The gradient is the saved one scaled by grad_output: cross_entropy's backward.
DISTILLATION_LOSS = Op(
    "distillation_loss",
    "(Tensor student_logits, Tensor teacher_logits, float temperature, str reduction, "
    "bool with_grad) -> (Tensor, Tensor)", _distillation_fake,
    reference=distillation_loss_reference,
    reference_kernels=(_distillation_reference_forward, None),
    probes=(Probe("1000 classes", _distillation_probe(40, 1000), constant=(1,)),
            Probe.real("BERT-base, 1024 x 30522", _distillation_probe(1024, 30522), constant=(1,))),
).differentiable(None, None, _saved_grad_setup, _cross_entropy_grad, twice=False)


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
    _check_labels(labels, hidden.shape[:-1], vocab, ignore_index)
    return choose("masked_lm_loss", device, backend, dtype=hidden.dtype)


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
    loss, *_ = MASKED_LM_LOSS(choice.backend, hidden, weight, bias, labels, ignore_index,
                              float(label_smoothing), reduction, chunk_rows,
                              *_wants_grad(hidden, weight, bias))
    return loss


def _grads_like(hidden, weight, bias, needs, computed):
    """Fake gradients: real shapes where computed and asked for, else absent."""
    def like(t, need):
        return t.new_empty(t.shape) if computed and need and t is not None else None
    return like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])


def _masked_lm_loss_fake(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction,
                         chunk_rows, *needs):
    shape = labels.shape if reduction == "none" else ()
    loss = hidden.new_empty(shape, dtype=_acc_dtype(hidden.dtype))
    return (loss, *_grads_like(hidden, weight, bias, needs, reduction != "none"))


def _masked_lm_loss_fake_backward(grad, hidden, weight, bias, labels, dhidden, dweight, dbias,
                                  ignore_index, label_smoothing, reduction, chunk_rows, *needs):
    return _grads_like(hidden, weight, bias, needs, True)


def _masked_lm_loss_setup(ctx, inputs, output):
    hidden, weight, bias, labels, *options = inputs[:8]
    ctx.options = options  # ignore_index, label_smoothing, reduction, chunk_rows
    ctx.needs = inputs[8:]  # need_dhidden, need_dweight, need_dbias
    ctx.save_for_backward(hidden, weight, bias, labels, *output[1:])
    _non_differentiable(ctx, *output[1:])


def _masked_lm_loss_grad(ctx, grad, *_grad_of_grads):
    if grad is None:
        return ()
    hidden, weight, bias, labels, dhidden, dweight, dbias = ctx.saved_tensors
    if _unit_grad(grad, ctx.options[2]):
        grads = dhidden, dweight, dbias
    else:
        grads = MASKED_LM_LOSS.backward(ctx, grad, hidden, weight, bias, labels, dhidden, dweight,
                                        dbias, *ctx.options, *ctx.needs)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs))


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


def _masked_lm_probe(rows, hidden, vocab):
    def make(g):
        return (randn(g, rows, hidden), randn(g, vocab, hidden, scale=hidden ** -0.5),
                randn(g, vocab), probe_labels(g, rows, vocab, labelled=0.15)), {}
    return make


MASKED_LM_LOSS = Op(
    "masked_lm_loss",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, SymInt ignore_index, "
    "float label_smoothing, str reduction, SymInt chunk_rows, bool need_dhidden, "
    "bool need_dweight, bool need_dbias) -> (Tensor, Tensor, Tensor, Tensor)", _masked_lm_loss_fake,
    reference=masked_lm_loss_reference,
    reference_kernels=(_masked_lm_loss_reference_forward, _masked_lm_loss_reference_backward),
    probes=(Probe("vocab 1000", _masked_lm_probe(60, 64, 1000)),
            Probe.real("BERT-base, 1024 x 768 -> 30522", _masked_lm_probe(1024, 768, 30522))),
).differentiable(
    "(Tensor grad, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor dhidden, "
    "Tensor dweight, Tensor dbias, SymInt ignore_index, float label_smoothing, str reduction, "
    "SymInt chunk_rows, bool need_dhidden, bool need_dweight, bool need_dbias) "
    "-> (Tensor, Tensor, Tensor)",
    _masked_lm_loss_fake_backward, _masked_lm_loss_setup, _masked_lm_loss_grad)
