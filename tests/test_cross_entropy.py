"""cross_entropy, distillation_loss and masked_lm_loss against the reference, on every
backend that has them: small cases, and BERT-base and GPT-2-small shapes on a GPU."""
import importlib
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case
from helpers import (as_reference, assert_close, assert_relative_error, backend_device, backends_for,
                     fresh, gpu_test, grads, leaves_float_mode_as_found, poison_memory, slow_backend)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
ce_module = importlib.import_module("fusedlm.ops.cross_entropy")


def labels_for(shape, classes, device, ignore_index=-100, ignored=0.3):
    """Random class labels with about `ignored` of them set to ignore_index (never all, never none
    on more than a handful of rows)."""
    labels = torch.randint(0, classes, shape)
    drop = torch.rand(shape) < ignored
    return labels.masked_fill(drop, ignore_index).to(device)


def upstream_grad(loss, reduction):
    """grad_output for a backward: 1 for "mean" (the backward then hands out the saved
    gradients unscaled), random for "sum" and "none" (it scales them)."""
    return torch.ones_like(loss) if reduction == "mean" else torch.rand_like(loss) + 0.5


def loss_tolerance(reduction, rows):
    # A sum over rows adds the rounding of that many float32 terms.
    return 1.0 if reduction == "none" else max(1.0, rows / 50)


# --- cross_entropy -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_cross_entropy_matches_reference(backend, dtype, reduction, label_smoothing, ignore_index):
    device = backend_device(backend)
    batch = (2, 5) if slow_backend(backend) else (3, 37)
    logits = fresh((*batch, 203), dtype, device, scale=3.0)
    labels = labels_for(batch, 203, device, ignore_index)
    before = logits.detach().clone()
    loss = fusedlm.ops.cross_entropy(logits, labels, ignore_index=ignore_index,
                                     label_smoothing=label_smoothing, reduction=reduction, backend=backend)
    assert torch.equal(logits.detach(), before), "the forward wrote into the caller's logits"
    grad = upstream_grad(loss, reduction)
    loss.backward(grad)
    assert torch.equal(logits.detach(), before), "the backward wrote into the caller's logits"

    (ref_logits,) = as_reference(logits)
    expected = reference.cross_entropy(ref_logits, labels, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction=reduction)
    expected.backward(grad.double())
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert_close(loss, expected, scale=loss_tolerance(reduction, labels.numel()), name="loss")
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, ref_logits.grad, name="dlogits")


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("offset", [0, 1])
def test_cross_entropy_row_alignment(backend, dtype, reduction, offset):
    # 200 classes: every row of logits at offset 0 starts on a 16-byte boundary, and the
    # cuda kernel and the backward's scaling take whole vectors only; logits that start one
    # element past one (a contiguous view) go to the kernel that takes one element at a time.
    device = backend_device(backend)
    flat = fresh((offset + 4 * 9 * 200,), dtype, device, scale=3.0, requires_grad=False)
    logits = flat[offset:].view(4, 9, 200).requires_grad_()
    labels = labels_for((4, 9), 200, device)
    loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=0.1, reduction=reduction,
                                     backend=backend)
    grad = upstream_grad(loss, reduction)
    (dlogits,) = torch.autograd.grad(loss, logits, grad)
    (ref,) = as_reference(logits)
    expected = reference.cross_entropy(ref, labels, label_smoothing=0.1, reduction=reduction)
    (ref_grad,) = torch.autograd.grad(expected, ref, grad.double())
    assert_close(loss, expected, scale=loss_tolerance(reduction, labels.numel()), name="loss")
    assert_close(dlogits, ref_grad, name="dlogits")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_cross_entropy_gradcheck(reduction, label_smoothing):
    logits = fresh((2, 3, 5), torch.float64, "cpu")
    labels = torch.tensor([[0, 4, -100], [2, -100, 1]])

    def f(x):
        return fusedlm.ops.cross_entropy(x, labels, label_smoothing=label_smoothing,
                                         reduction=reduction, backend="cpu")

    assert f(logits).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (logits,))


def test_cross_entropy_every_instruction_set(cpu_isa):
    # Class counts around the vector width and the kernel's block of 2048 classes.
    for classes in (1, 7, 16, 33, 1000, 2047, 2049, 4113):
        for dtype in DTYPES:
            logits = fresh((5, classes), dtype, "cpu", scale=4.0)
            labels = labels_for((5,), classes, "cpu", ignored=0.2)
            loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=0.1, reduction="none",
                                             backend="cpu")
            (dlogits,) = torch.autograd.grad(loss.sum(), logits)
            (ref,) = as_reference(logits)
            expected = reference.cross_entropy(ref, labels, label_smoothing=0.1, reduction="none")
            (ref_grad,) = torch.autograd.grad(expected.sum(), ref)
            name = f"{cpu_isa} {dtype} classes={classes}"
            assert_close(loss, expected, name=f"{name} loss")
            assert_close(dlogits, ref_grad, name=f"{name} dlogits")


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), classes=st.integers(1, 300), scale=st.floats(0.1, 30.0),
       ignored=st.floats(0.0, 1.0), label_smoothing=st.sampled_from([0.0, 0.05, 1.0]),
       reduction=st.sampled_from(REDUCTIONS))
def test_cross_entropy_random_shapes(rows, classes, scale, ignored, label_smoothing, reduction):
    logits = fresh((rows, classes), torch.float32, "cpu", scale=scale)
    labels = labels_for((rows,), classes, "cpu", ignored=ignored)
    loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=label_smoothing,
                                     reduction=reduction, backend="cpu")
    grad = torch.rand_like(loss) + 0.5
    loss.backward(grad)
    (ref,) = as_reference(logits)
    expected = reference.cross_entropy(ref, labels, label_smoothing=label_smoothing, reduction=reduction)
    expected.backward(grad.double())
    # Logits of scale 30 make losses of that size: compare relative to it.
    tol = loss_tolerance(reduction, rows) * max(1.0, scale / 3)
    assert_close(loss, expected, scale=tol, name="loss")
    assert_close(logits.grad, ref.grad, name="dlogits")


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
def test_cross_entropy_all_labels_ignored(backend):
    device = backend_device(backend)
    logits = fresh((4, 6, 50), torch.float32, device)
    labels = torch.full((4, 6), -100, device=device)
    for reduction in REDUCTIONS:
        loss = fusedlm.ops.cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1,
                                         backend=backend)
        (dlogits,) = torch.autograd.grad(loss.sum(), logits)
        assert torch.equal(loss, torch.zeros_like(loss)), reduction
        assert torch.equal(dlogits, torch.zeros_like(dlogits)), reduction


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
def test_cross_entropy_refuses_labels_past_the_classes(backend):
    # On every device without FUSEDLM_DEBUG: a loss is one call a step, so its labels are
    # checked even where that synchronises.
    device = backend_device(backend)
    logits = fresh((3, 50), torch.float32, device)
    for bad in (50, -1):
        labels = torch.tensor([1, bad, -100], device=device)
        with pytest.raises(ValueError, match=f"labels must be class indices .* got {bad}"):
            fusedlm.ops.cross_entropy(logits, labels, backend=backend)


class _Event:
    """Stands in for a device event: complete once a test says so (or once waited for)."""

    def __init__(self):
        self.complete = False

    def record(self):
        pass

    def query(self):
        return self.complete

    def synchronize(self):
        self.complete = True


def test_a_gpu_label_check_raises_in_a_later_call_without_waiting_for_it():
    # On a GPU the check's verdict travels to the host behind an event; a later loss call
    # reads it once the event has completed, and never waits for one that has not.
    checks = ce_module._LabelChecks()
    first, second, third = _Event(), _Event(), _Event()
    checks.add(torch.tensor([1, 99, -100, 12]), 10, -100, "masked_lm_loss", event=first)
    checks.add(torch.tensor([1, 2]), 10, -100, "cross_entropy", event=second)  # not complete yet
    first.complete = True
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 10\) or "
                       r"ignore_index \(-100\), got 99 \(in the labels of an earlier "
                       r"masked_lm_loss call"):
        checks.raise_found()
    second.complete = True
    checks.add(torch.tensor([3, -100]), 10, -100, "cross_entropy", event=third)  # good: silent
    assert [v.event for v in checks._pending] == [third]


def test_a_full_backlog_of_gpu_label_checks_waits_for_the_oldest():
    checks = ce_module._LabelChecks()
    events = [_Event() for _ in range(checks.BACKLOG + 1)]
    checks.add(torch.tensor([-5]), 10, -100, "cross_entropy", event=events[0])
    for event in events[1:-1]:
        checks.add(torch.tensor([0]), 10, -100, "cross_entropy", event=event)
    with pytest.raises(ValueError, match="got -5"):
        checks.add(torch.tensor([0]), 10, -100, "cross_entropy", event=events[-1])
    assert events[0].complete


@gpu_test
def test_a_bad_label_on_a_gpu_raises_at_a_later_call():
    logits = torch.randn(3, 10, device="cuda")
    fusedlm.ops.cross_entropy(logits, torch.tensor([1, 10, -100], device="cuda"), backend="cuda")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="got 10 .in the labels of an earlier cross_entropy call"):
        fusedlm.ops.cross_entropy(logits, torch.tensor([1, 2, 3], device="cuda"), backend="cuda")


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
def test_cross_entropy_unchecked_bad_label_gives_nan_not_a_stray_read(backend, monkeypatch):
    # Where the planner cannot read the labels (torch.compile tracing, a CUDA graph
    # capturing), a GPU kernel's row with a label past the classes gets a NaN loss and the
    # other rows are exact; the cpu backend reads them in its host code anyway.
    monkeypatch.setattr(ce_module, "check_index_data", lambda *_, **__: False)
    device = backend_device(backend)
    logits = fresh((4, 50), torch.float32, device, requires_grad=False)
    labels = torch.tensor([1, 50, -100, -7], device=device)
    if backend == "cpu":
        with pytest.raises(ValueError, match="labels"):
            fusedlm.ops.cross_entropy(logits, labels, reduction="none", backend=backend)
        return
    loss = fusedlm.ops.cross_entropy(logits, labels, reduction="none", backend=backend)
    expected = reference.cross_entropy(logits[:1], labels[:1], reduction="none")
    assert torch.isnan(loss[1]) and torch.isnan(loss[3]) and loss[2] == 0
    assert_close(loss[:1], expected, name="loss")


def test_cross_entropy_far_logits_restore_the_thread(cpu_isa):
    # Logits 85 below the row's largest give probabilities and gradients below float's
    # normal range, which the cpu kernels flush to 0; the results still match, and the
    # thread's arithmetic is left as it was found.
    logits = torch.zeros(4, 64)
    logits[:, 1:] = -85.0 - torch.rand(4, 63)
    logits.requires_grad_()
    labels = torch.tensor([0, 1, 5, 0])
    with leaves_float_mode_as_found(cpu_isa):
        loss = fusedlm.ops.cross_entropy(logits, labels, reduction="none", backend="cpu")
        (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    (ref,) = as_reference(logits)
    expected = reference.cross_entropy(ref, labels, reduction="none")
    (ref_grad,) = torch.autograd.grad(expected.sum(), ref)
    assert_close(loss, expected, name=f"{cpu_isa} loss")
    assert_close(dlogits, ref_grad, name=f"{cpu_isa} dlogits")


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cross_entropy_large_logits(backend, dtype):
    # Logits near the largest values of the dtype (for bfloat16, small enough that a loss
    # of 2 * big still fits float32): the kernel works in float32 relative to the row max.
    big = 6e4 if dtype == torch.float16 else 1e38
    logits = fresh((6, 40), torch.float32, "cpu", requires_grad=False)
    logits[:, :3] = torch.tensor([big, -big, big / 2])
    device = backend_device(backend)
    logits = logits.to(dtype=dtype, device=device).requires_grad_()
    labels = torch.tensor([0, 1, 2, 3, -100, 0], device=device)
    loss = fusedlm.ops.cross_entropy(logits, labels, reduction="none", backend=backend)
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    assert torch.isfinite(loss).all() and torch.isfinite(dlogits).all()
    (ref,) = as_reference(logits)
    expected = reference.cross_entropy(ref, labels, reduction="none")
    (ref_grad,) = torch.autograd.grad(expected.sum(), ref)
    assert_close(loss, expected, name="loss")
    assert_close(dlogits, ref_grad, name="dlogits")


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
def test_cross_entropy_masked_classes(backend):
    # -inf logits (a masked vocabulary), filling whole leading blocks of classes (the kernels
    # take 2048 or 4096 at a time): they add nothing to the sum and get a zero gradient.
    device = backend_device(backend)
    logits = fresh((3, 9000), torch.float32, device, requires_grad=False)
    logits[:, :8500] = float("-inf")
    logits[1, 8990:] = float("-inf")
    logits.requires_grad_()
    labels = torch.tensor([8600, 8700, 8999 - 10], device=device)
    loss = fusedlm.ops.cross_entropy(logits, labels, reduction="none", backend=backend)
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    (ref,) = as_reference(logits)
    expected = reference.cross_entropy(ref, labels, reduction="none")
    (ref_grad,) = torch.autograd.grad(expected.sum(), ref)
    assert_close(loss, expected, name="loss")
    assert_close(dlogits, ref_grad, name="dlogits")
    assert torch.equal(dlogits[:, :8500], torch.zeros_like(dlogits[:, :8500]))


def test_cross_entropy_without_grad_and_strided_input():
    # Transposed (non-contiguous) logits; the loss-only path under no_grad agrees with the fused one.
    logits = fresh((120, 9), torch.float32, "cpu").t()
    labels = labels_for((9,), 120, "cpu")
    with_grad = fusedlm.ops.cross_entropy(logits, labels, backend="cpu")
    with torch.no_grad():
        without = fusedlm.ops.cross_entropy(logits, labels, backend="cpu")
    assert torch.equal(with_grad.detach(), without)
    assert_close(without, reference.cross_entropy(logits.detach().double(), labels))


def test_cross_entropy_is_deterministic_across_thread_counts():
    logits = fresh((300, 3000), torch.float32, "cpu")
    labels = labels_for((300,), 3000, "cpu")
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=0.1, backend="cpu")
            results.append((loss.detach(), *torch.autograd.grad(loss, logits)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cross_entropy_backward_through_retained_graph():
    # A scaled backward scales a copy of the saved gradient, and .grad accumulation copies an
    # unscaled one: passing over the graph again gives the same gradients.
    logits = fresh((7, 30), torch.float32, "cpu")
    labels = labels_for((7,), 30, "cpu")
    loss = fusedlm.ops.cross_entropy(logits, labels, reduction="sum", backend="cpu")
    (first,) = torch.autograd.grad(loss * 2, logits, retain_graph=True)
    (second,) = torch.autograd.grad(loss * 3, logits, retain_graph=True)
    torch.testing.assert_close(second, first * 1.5)
    loss.backward(retain_graph=True)
    once = logits.grad.clone()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(logits.grad, 2 * once)
    torch.testing.assert_close(once, first / 2)
    # An unscaled gradient handed out while the graph is kept aliases the saved one: changing
    # it in place makes a later backward raise rather than use it.
    (unscaled,) = torch.autograd.grad(loss, logits, retain_graph=True)
    unscaled.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_cross_entropy_compiles_without_graph_breaks():
    logits = fresh((4, 9, 70), torch.float32, "cpu")
    labels = labels_for((4, 9), 70, "cpu")
    compiled = torch.compile(
        lambda x, y: fusedlm.ops.cross_entropy(x * 2, y, label_smoothing=0.1, backend="cpu") + 1,
        fullgraph=True)
    loss = compiled(logits, labels)
    loss.backward()
    (ref,) = as_reference(logits)
    expected = reference.cross_entropy(ref * 2, labels, label_smoothing=0.1) + 1
    expected.backward()
    assert_close(loss, expected)
    assert_close(logits.grad, ref.grad)


@pytest.mark.parametrize("backend", backends_for("cross_entropy"))
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_cross_entropy_outputs_are_not_views(backend, reduction):
    # FSDP2 warns about, and cannot follow in-place changes to, a view a module returns.
    device = backend_device(backend)
    logits = fresh((2, 3, 10), torch.float32, device)
    with torch.no_grad():
        loss, grad = torch.ops.fusedlm.cross_entropy(logits, labels_for((2, 3), 10, device), -100,
                                                     0.0, reduction, True, backend)
        dlogits = torch.ops.fusedlm.cross_entropy_backward(torch.ones_like(loss), grad, reduction,
                                                           backend)
    assert [t._base is None for t in (loss, grad, dlogits)] == [True] * 3


def test_cross_entropy_rejects_bad_input():
    logits = torch.randn(4, 10)
    labels = torch.tensor([1, 2, 3, -100])
    with pytest.raises(ValueError, match="labels"):
        fusedlm.ops.cross_entropy(logits, torch.tensor([1, 2, 10, 0]))
    with pytest.raises(ValueError, match="labels"):
        fusedlm.ops.cross_entropy(logits, torch.tensor([1, -1, 3, 0]))
    with pytest.raises(ValueError, match="labels"):
        fusedlm.ops.cross_entropy(logits, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="labels"):
        fusedlm.ops.cross_entropy(logits, labels.float())
    with pytest.raises(TypeError, match="labels"):
        fusedlm.ops.cross_entropy(logits, labels.int())
    with pytest.raises(TypeError, match="logits"):
        fusedlm.ops.cross_entropy(logits.long(), labels)
    with pytest.raises(ValueError, match="logits"):
        fusedlm.ops.cross_entropy(torch.randn(4, 0), labels)
    with pytest.raises(ValueError, match="reduction"):
        fusedlm.ops.cross_entropy(logits, labels, reduction="max")
    with pytest.raises(ValueError, match="label_smoothing"):
        fusedlm.ops.cross_entropy(logits, labels, label_smoothing=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        fusedlm.ops.cross_entropy(logits, labels, ignore_index=0.5)
    with pytest.raises(ValueError, match="labels"):
        fusedlm.ops.cross_entropy(logits, labels.to("meta"))
    # The compiled kernel checks labels itself, for callers that bypass the Python checks.
    with pytest.raises(ValueError, match="labels"):
        torch.ops.fusedlm.cross_entropy(logits, torch.tensor([1, 2, 10, 0]), -100, 0.0, "mean", True, "cpu")


# --- distillation_loss ---------------------------------------------------------------------------

def _distillation_inputs(shape, dtype, device):
    student = fresh(shape, dtype, device, scale=3.0)
    teacher = fresh(shape, dtype, device, scale=3.0, requires_grad=False)
    return student, teacher


@pytest.mark.parametrize("backend", backends_for("distillation_loss"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_distillation_loss_matches_reference(backend, dtype, reduction, temperature):
    device = backend_device(backend)
    batch = (2, 5) if slow_backend(backend) else (3, 37)
    student, teacher = _distillation_inputs((*batch, 203), dtype, device)
    before = student.detach().clone()
    loss = fusedlm.ops.distillation_loss(student, teacher, temperature=temperature,
                                         reduction=reduction, backend=backend)
    grad = upstream_grad(loss, reduction)
    loss.backward(grad)
    assert torch.equal(student.detach(), before), "the op wrote into the caller's logits"

    ref_student, ref_teacher = as_reference(student, teacher)
    expected = reference.distillation_loss(ref_student, ref_teacher, temperature=temperature,
                                           reduction=reduction)
    expected.backward(grad.double())
    assert loss.dtype == torch.float32 and loss.shape == expected.shape == grad.shape
    assert_close(loss, expected, scale=loss_tolerance(reduction, batch[0] * batch[1]), name="loss")
    assert student.grad.dtype == dtype
    assert_close(student.grad, ref_student.grad, name="dstudent")


def test_distillation_loss_is_distilberts_formula():
    # KLDivLoss(batchmean) of log_softmax(s / T) against softmax(t / T), times T², over the
    # rows, as DistilBERT's distiller writes it; float64 on the CPU kernel.
    s, t = torch.randn(6, 50, dtype=torch.float64) * 2, torch.randn(6, 50, dtype=torch.float64) * 2
    expected = torch.nn.KLDivLoss(reduction="batchmean")(
        torch.log_softmax(s / 3.0, dim=-1), torch.softmax(t / 3.0, dim=-1)) * 9.0
    got = fusedlm.ops.distillation_loss(s, t, temperature=3.0, backend="cpu")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    # The same student and teacher: no divergence, no gradient.
    s.requires_grad_()
    same = fusedlm.ops.distillation_loss(s, s.detach(), temperature=3.0, backend="cpu")
    (g,) = torch.autograd.grad(same, s)
    assert abs(same.item()) < 1e-13 and g.abs().max() < 1e-15


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_distillation_loss_gradcheck(reduction):
    student = torch.randn(3, 4, 17, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 4, 17, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda s: fusedlm.ops.distillation_loss(s, teacher, temperature=1.5, reduction=reduction,
                                                backend="cpu"), (student,))


def test_distillation_loss_every_instruction_set(cpu_isa):
    for classes in (1, 7, 16, 33, 1000, 2049):
        for dtype in DTYPES:
            student, teacher = _distillation_inputs((5, classes), dtype, "cpu")
            loss = fusedlm.ops.distillation_loss(student, teacher, temperature=2.0, reduction="none",
                                                 backend="cpu")
            (got,) = torch.autograd.grad(loss.sum(), student)
            ref_student, ref_teacher = as_reference(student, teacher)
            expected = reference.distillation_loss(ref_student, ref_teacher, temperature=2.0,
                                                   reduction="none")
            (expected_grad,) = torch.autograd.grad(expected.sum(), ref_student)
            name = f"{cpu_isa} {dtype} classes={classes}"
            assert_close(loss, expected, name=f"{name} loss")
            assert_close(got, expected_grad, name=f"{name} dstudent")


@pytest.mark.parametrize("backend", backends_for("distillation_loss"))
def test_distillation_loss_classes_the_teacher_rules_out(backend):
    # A class of teacher logit -inf has probability 0 and adds nothing (not 0 * inf).
    device = backend_device(backend)
    student, teacher = _distillation_inputs((4, 30), torch.float32, device)
    teacher = teacher.clone()
    teacher[:, :5] = float("-inf")
    loss = fusedlm.ops.distillation_loss(student, teacher, reduction="none", backend=backend)
    (got,) = torch.autograd.grad(loss.sum(), student)
    ref_student, ref_teacher = as_reference(student, teacher)
    expected = reference.distillation_loss(ref_student, ref_teacher, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum(), ref_student)
    assert torch.isfinite(loss).all() and torch.isfinite(got).all()
    assert_close(loss, expected, name="loss")
    assert_close(got, expected_grad, name="dstudent")


def test_distillation_loss_compiles_without_graph_breaks():
    student, teacher = _distillation_inputs((4, 7, 50), torch.float32, "cpu")

    def f(s, t):
        return fusedlm.ops.distillation_loss(s * 2, t, temperature=2.0) + 1

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    got = compiled(student, teacher)
    (g,) = torch.autograd.grad(got, student)
    ref_student, ref_teacher = as_reference(student, teacher)
    expected = reference.distillation_loss(ref_student * 2, ref_teacher, temperature=2.0) + 1
    (expected_grad,) = torch.autograd.grad(expected, ref_student)
    assert_close(got, expected, name="loss")
    assert_close(g, expected_grad, name="dstudent")


def test_distillation_loss_rejects_bad_input():
    s, t = torch.randn(4, 10, requires_grad=True), torch.randn(4, 10)
    cases = [((s, t[:, :9]), {}, ValueError, "teacher_logits"),
             ((s, t.double()), {}, TypeError, "teacher_logits"),
             ((s, t), {"temperature": 0.0}, ValueError, "temperature"),
             ((s, t), {"temperature": float("inf")}, ValueError, "temperature"),
             ((s, t), {"reduction": "batchmean"}, ValueError, "reduction"),
             ((s.long(), t), {}, TypeError, "student_logits"),
             ((torch.randn(4, 0), torch.randn(4, 0)), {}, ValueError, "student_logits"),
             ((s, t.requires_grad_()), {}, ValueError, "teacher_logits must not require grad")]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            fusedlm.ops.distillation_loss(*args, **kwargs)
    # The compiled kernel checks shapes itself, for callers that bypass the Python checks.
    with pytest.raises(ValueError, match="teacher_logits"):
        torch.ops.fusedlm.distillation_loss(s.detach(), torch.randn(4, 9), 1.0, "mean", False, "cpu")


# --- masked_lm_loss ------------------------------------------------------------------------------

def _mlm_inputs(dtype, device, width=24, vocab=203, shape=(2, 13), with_bias=True, ignore_index=-100):
    hidden = fresh((*shape, width), dtype, device)
    weight = fresh((vocab, width), dtype, device, scale=width ** -0.5)
    bias = fresh((vocab,), dtype, device) if with_bias else None
    labels = labels_for(shape, vocab, device, ignore_index, ignored=0.6)
    return hidden, weight, bias, labels


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 rows, so a few labelled rows already take several chunks."""
    def use(vocab, dtype):
        monkeypatch.setattr(ce_module, "LOGITS_CHUNK_BYTES", 4 * vocab * torch.finfo(dtype).bits // 8)
    return use


@pytest.mark.parametrize("backend", backends_for("masked_lm_loss"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_masked_lm_loss_matches_reference(backend, dtype, reduction, label_smoothing, with_bias,
                                          small_chunks):
    small_chunks(203, dtype)
    ignore_index = -100 if with_bias else 7
    inputs = _mlm_inputs(dtype, backend_device(backend), with_bias=with_bias, ignore_index=ignore_index)
    hidden, weight, bias, labels = inputs
    kwargs = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    loss = fusedlm.ops.masked_lm_loss(*inputs, **kwargs, backend=backend)
    grad = upstream_grad(loss, reduction)
    loss.backward(grad)

    ref_inputs = as_reference(hidden, weight, bias)
    expected = reference.masked_lm_loss(*ref_inputs, labels, **kwargs)
    expected.backward(grad.double())
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    # Half-precision logits are rounded products: allow for it, as gelu_ffn's tests do.
    scale = 1 if dtype == torch.float32 else 3
    assert_close(loss, expected, dtype=dtype, scale=scale * loss_tolerance(reduction, 26), name="loss")
    for name, t, r in zip(("hidden", "weight", "bias"), (hidden, weight, bias), ref_inputs):
        if t is not None:
            assert t.grad.dtype == dtype
            assert_close(t.grad, r.grad, scale=10 * scale, name=f"d{name}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_masked_lm_loss_gradcheck(reduction, small_chunks):
    small_chunks(6, torch.float64)
    hidden = fresh((2, 5, 3), torch.float64, "cpu")
    weight = fresh((6, 3), torch.float64, "cpu")
    bias = fresh((6,), torch.float64, "cpu")
    labels = torch.tensor([[0, -100, 5, 2, 3], [-100, 1, 1, 4, -100]])

    def f(h, w, b):
        return fusedlm.ops.masked_lm_loss(h, w, b, labels, label_smoothing=0.1, reduction=reduction,
                                          backend="cpu")

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(0, 30), width=st.integers(1, 40), vocab=st.integers(1, 120),
       ignored=st.floats(0.0, 1.0), chunk=st.integers(1, 12), reduction=st.sampled_from(REDUCTIONS))
def test_masked_lm_loss_random_shapes(rows, width, vocab, ignored, chunk, reduction):
    hidden = fresh((rows, width), torch.float32, "cpu")
    weight = fresh((vocab, width), torch.float32, "cpu", scale=width ** -0.5)
    bias = fresh((vocab,), torch.float32, "cpu")
    labels = labels_for((rows,), vocab, "cpu", ignored=ignored)
    saved = ce_module.LOGITS_CHUNK_BYTES
    ce_module.LOGITS_CHUNK_BYTES = chunk * vocab * 4
    try:
        loss = fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels, reduction=reduction, backend="cpu")
    finally:
        ce_module.LOGITS_CHUNK_BYTES = saved
    grad = torch.rand_like(loss) + 0.5
    loss.backward(grad)
    ref_inputs = as_reference(hidden, weight, bias)
    expected = reference.masked_lm_loss(*ref_inputs, labels, reduction=reduction)
    expected.backward(grad.double())
    assert_close(loss, expected, scale=loss_tolerance(reduction, rows), name="loss")
    for name, t, r in zip(("hidden", "weight", "bias"), (hidden, weight, bias), ref_inputs):
        assert_close(t.grad, r.grad, scale=10, name=f"d{name}")


@pytest.mark.parametrize("backend", backends_for("masked_lm_loss"))
def test_masked_lm_loss_all_labels_ignored(backend):
    device = backend_device(backend)
    hidden, weight, bias, _ = _mlm_inputs(torch.float32, device)
    labels = torch.full(hidden.shape[:-1], -100, device=device)
    for reduction in REDUCTIONS:
        loss = fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels, reduction=reduction,
                                          backend=backend)
        grads = torch.autograd.grad(loss.sum(), (hidden, weight, bias))
        assert torch.equal(loss, torch.zeros_like(loss)), reduction
        for g in grads:
            assert torch.equal(g, torch.zeros_like(g)), reduction


@pytest.mark.parametrize("backend", backends_for("masked_lm_loss"))
def test_masked_lm_loss_refuses_labels_past_the_vocabulary(backend):
    # As cross_entropy: checked on every device without FUSEDLM_DEBUG.
    device = backend_device(backend)
    hidden, weight, bias, labels = _mlm_inputs(torch.float32, device)
    for bad in (weight.shape[0], -1):
        wrong = labels.clone()
        wrong.view(-1)[3] = bad
        with pytest.raises(ValueError, match=f"labels must be class indices .* got {bad}"):
            fusedlm.ops.masked_lm_loss(hidden, weight, bias, wrong, backend=backend)


def test_masked_lm_loss_frozen_weight_and_default_chunks():
    # Only hidden needs a gradient; the default chunk size (one chunk here).
    hidden, weight, bias, labels = _mlm_inputs(torch.float32, "cpu", vocab=333, shape=(3, 40))
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    loss = fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels, backend="cpu")
    loss.backward()
    assert weight.grad is None and bias.grad is None
    (ref_hidden,) = as_reference(hidden)
    expected = reference.masked_lm_loss(ref_hidden, weight.double(), bias.double(), labels)
    expected.backward()
    assert_close(loss, expected)
    assert_close(hidden.grad, ref_hidden.grad)


def test_masked_lm_loss_retained_graph_and_no_grad(small_chunks):
    small_chunks(203, torch.float32)
    inputs = _mlm_inputs(torch.float32, "cpu")
    hidden, weight, bias, labels = inputs
    loss = fusedlm.ops.masked_lm_loss(*inputs, label_smoothing=0.1, backend="cpu")
    first = torch.autograd.grad(loss * 2, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss * 3, (hidden, weight, bias), retain_graph=True)
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a * 1.5)
    loss.backward(retain_graph=True)
    loss.backward()
    for t, a in zip((hidden, weight, bias), first):
        torch.testing.assert_close(t.grad, a)
    with torch.no_grad():
        loss_only = fusedlm.ops.masked_lm_loss(*inputs, label_smoothing=0.1, backend="cpu")
    torch.testing.assert_close(loss_only, loss.detach(), rtol=0, atol=1e-6)


def test_masked_lm_loss_compiles_without_graph_breaks(small_chunks):
    small_chunks(203, torch.float32)
    inputs = _mlm_inputs(torch.float32, "cpu")
    hidden, weight, bias, labels = inputs
    compiled = torch.compile(
        lambda h, w, b, y: fusedlm.ops.masked_lm_loss(h * 2, w, b, y, reduction="sum", backend="cpu") / 4,
        fullgraph=True)
    loss = compiled(*inputs)
    loss.backward()
    ref_inputs = as_reference(hidden, weight, bias)
    expected = reference.masked_lm_loss(ref_inputs[0] * 2, *ref_inputs[1:], labels, reduction="sum") / 4
    expected.backward()
    assert_close(loss, expected)
    for t, r in zip((hidden, weight, bias), ref_inputs):
        assert_close(t.grad, r.grad, scale=10)


@pytest.mark.parametrize("backend", backends_for("masked_lm_loss"))
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_masked_lm_loss_outputs_are_not_views(backend, reduction):
    hidden, weight, bias, labels = _mlm_inputs(torch.float32, backend_device(backend))
    needs = [True, True, True]
    with torch.no_grad():
        outputs = torch.ops.fusedlm.masked_lm_loss(hidden, weight, bias, labels, -100, 0.0,
                                                   reduction, 4, *needs, backend)
        grads = torch.ops.fusedlm.masked_lm_loss_backward(
            torch.ones_like(outputs[0]), hidden, weight, bias, labels, *outputs[1:], -100, 0.0,
            reduction, 4, *needs, backend)
    assert [t._base is None for t in (*outputs, *grads)] == [True] * 7


def test_masked_lm_loss_rejects_bad_input():
    hidden, weight, bias, labels = _mlm_inputs(torch.float32, "cpu")
    vocab = weight.shape[0]
    with pytest.raises(ValueError, match="labels"):
        fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels.masked_fill(labels == -100, vocab))
    with pytest.raises(ValueError, match="labels"):
        fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels[:, :-1])
    with pytest.raises(TypeError, match="labels"):
        fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels.double())
    with pytest.raises(ValueError, match="weight"):
        fusedlm.ops.masked_lm_loss(hidden, weight[:, :-1], bias, labels)
    with pytest.raises(ValueError, match="bias"):
        fusedlm.ops.masked_lm_loss(hidden, weight, bias[:-1], labels)
    with pytest.raises(TypeError, match="weight"):
        fusedlm.ops.masked_lm_loss(hidden, weight.double(), bias, labels)
    with pytest.raises(TypeError, match="hidden"):
        fusedlm.ops.masked_lm_loss(hidden.long(), weight, bias, labels)
    with pytest.raises(ValueError, match="weight"):
        fusedlm.ops.masked_lm_loss(hidden, weight.to("meta"), bias, labels)
    with pytest.raises(ValueError, match="reduction"):
        fusedlm.ops.masked_lm_loss(hidden, weight, bias, labels, reduction="avg")


# --- real shapes (a GPU) -------------------------------------------------------------------------

REAL_SHAPES = {"bert-base": (32 * 128, 30522), "gpt2-small": (8 * 1024, 50257)}  # (tokens, vocab)


def _real_labels(tokens, vocab, ignored):
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    return labels.masked_fill(torch.rand(tokens, device="cuda") < ignored, -100)


@pytest.mark.parametrize("backend", backends_for("cross_entropy", shapes="real"))
@pytest.mark.parametrize("shape", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_real_shapes(backend, shape, dtype, label_smoothing, reduction):
    tokens, vocab = shape
    logits = fresh(shape, dtype, "cuda", scale=3.0)
    labels = _real_labels(tokens, vocab, ignored=0.1)
    poison_memory()
    loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=label_smoothing,
                                     reduction=reduction, backend=backend)
    upstream = torch.rand_like(loss) + 0.5
    (got,) = grads([loss], [logits], [upstream])
    (ref,) = as_reference(logits, dtype=torch.float32)
    expected = reference.cross_entropy(ref, labels, label_smoothing=label_smoothing,
                                       reduction=reduction)
    (expected_grad,) = grads([expected], [ref], [upstream])
    # The loss is float32 whatever the logits' dtype.
    assert_relative_error(loss, expected, torch.float32, "loss")
    assert_relative_error(got, expected_grad, dtype, "dlogits")


@pytest.mark.parametrize("backend", backends_for("masked_lm_loss", shapes="real"))
@pytest.mark.parametrize("shape", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_masked_lm_loss_real_shapes(backend, shape, dtype, reduction):
    tokens, vocab = shape
    inputs = [fresh((tokens, 768), dtype, "cuda"), fresh((vocab, 768), dtype, "cuda", scale=768 ** -0.5),
              fresh((vocab,), dtype, "cuda")]
    labels = _real_labels(tokens, vocab, ignored=0.85)
    poison_memory()
    loss = fusedlm.ops.masked_lm_loss(*inputs, labels, reduction=reduction, backend=backend)
    upstream = torch.rand_like(loss) + 0.5
    got = grads([loss], inputs, [upstream])
    ref_inputs = as_reference(*inputs, dtype=torch.float32)
    expected = reference.masked_lm_loss(*ref_inputs, labels, reduction=reduction)
    expected_grads = grads([expected], ref_inputs, [upstream])
    # bf16 logits are rounded products: the loss is as exact as the dtype's logits.
    assert_relative_error(loss, expected, dtype, "loss")
    for name, a, e in zip(("dhidden", "dweight", "dbias"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def _plain_cross_entropy(logits, labels, ignore_index, label_smoothing, reduction,
                         log_softmax=torch.log_softmax):
    """F.cross_entropy's formula in logits' dtype; a mean over no labelled row is 0."""
    logp = log_softmax(logits, dim=-1)
    labelled = labels != ignore_index
    picked = logp.gather(-1, torch.where(labelled, labels, 0)[..., None])[..., 0]
    losses = -(1 - label_smoothing) * picked - label_smoothing * logp.mean(dim=-1)
    losses = torch.where(labelled, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / labelled.sum().clamp(min=1)


def _exact_log_softmax(logits, dim):
    """log_softmax without its cancellation at the largest logit: there it is
    -log1p(the other terms' sum), where z - logsumexp(z) keeps only the digits of the
    logsumexp's rounding (a 1e-10 loss in float64 was 2.5e-7 off)."""
    top = logits.argmax(dim, keepdim=True)
    shifted = logits - logits.gather(dim, top)
    others = torch.exp(shifted).scatter(dim, top, 0.0).sum(dim, keepdim=True)
    return shifted - torch.log1p(others)


def _cross_entropy_truth(logits, labels, **options):
    return _plain_cross_entropy(logits, labels, **options, log_softmax=_exact_log_softmax)


def _draw_labels(d, rows, classes):
    ignore_index = d.choice([-100, -100, 0, classes - 1])
    labels = torch.randint(0, classes, rows, generator=d.generator)
    ignored = torch.rand(rows, generator=d.generator) < d.choice([0.0, 0.5, 0.85, 1.0])
    d.index_tensor("labels", torch.where(ignored, torch.full_like(labels, ignore_index), labels))
    options = {"ignore_index": ignore_index, "reduction": d.choice(["mean", "sum", "none"]),
               "label_smoothing": d.choice([0.0, 0.0, 0.1, 1.0])}
    d.note(str(options))
    return options


def _labels_out_of_range(d, classes, ignore_index):
    labels = d.index["labels"].clone()
    if labels.numel() == 0:
        return []
    labels.view(-1)[0] = classes if classes != ignore_index else classes + 1
    return [fuzz.replaced("labels", labels, "a label past the classes")]


def draw_cross_entropy(d):
    dtype = d.dtype()
    classes = d.size(2, 3000, (2, 127, 128, 129, 1024, 2049))  # (see draw_masked_lm_loss)
    rows = tuple(d.size(0, 6, (1,)) for _ in range(d.size(0, 2)))
    # Not expanded over the classes: equal logits are a degenerate softmax.
    d.tensor("logits", (*rows, classes), dtype, scale=d.magnitude(100.0), expand_dims=range(len(rows)))
    options = _draw_labels(d, rows, classes)

    bad = [fuzz.with_extra_dim("labels"), *_labels_out_of_range(d, classes, options["ignore_index"])]
    return _loss_case("cross_entropy", f"classes={classes}", ("logits", "labels"),
                      _plain_cross_entropy, _cross_entropy_truth, options, dtype, bad)


def _loss_case(op, description, names, plain, truth, options, dtype, bad):
    """The case of a loss over the tensors `names` (its positional arguments), with its
    options as keywords: measured against `truth`, beside `plain` PyTorch's run."""
    def tensors(t):
        return tuple(t[name] for name in names)

    return Case(op, f"{op} {dtype} {description}", lambda t: (tensors(t), options),
                lambda t: (plain(*tensors(t), **options),), floors=(1.0,), dtype=dtype,
                bad=tuple(bad), truth=lambda t: (truth(*tensors(t), **options),))


def draw_masked_lm_loss(d):
    dtype = d.dtype()
    # At least two classes: a softmax over one is degenerate (its loss is zero by definition).
    width, vocab = d.size(1, 96, (1, 3, 64, 65)), d.size(2, 600, (2, 127, 128, 129))
    rows = tuple(d.size(0, 12, (1,)) for _ in range(d.size(1, 2)))
    d.tensor("hidden", (*rows, width), dtype, scale=d.magnitude(10.0))
    # Never expanded over the vocabulary: equal rows of weight or a constant bias make a
    # degenerate softmax, whose gradients are zero by symmetry.
    d.tensor("weight", (vocab, width), dtype, scale=width ** -0.5, expand_dims=(1,))
    if d.chance(0.7):
        d.tensor("bias", (vocab,), dtype, expand_dims=())
    options = _draw_labels(d, rows, vocab)

    def arguments(t):
        return (t["hidden"], t["weight"], t.get("bias"), t["labels"]), options

    def logits(t):
        return torch.nn.functional.linear(t["hidden"], t["weight"], t.get("bias"))

    def reference_(t):
        return (_plain_cross_entropy(logits(t), t["labels"], **options),)

    def truth(t):
        return (_cross_entropy_truth(logits(t), t["labels"], **options),)

    bad = [fuzz.grown("weight", 1), fuzz.with_extra_dim("labels"),
           *_labels_out_of_range(d, vocab, options["ignore_index"])]
    return Case("masked_lm_loss", f"masked_lm_loss {dtype} {width}->{vocab}", arguments, reference_,
                floors=(1.0,), dtype=dtype, bad=tuple(bad), truth=truth)


def _plain_distillation_loss(student, teacher, temperature, reduction):
    """DistilBERT's formula in the logits' dtype."""
    log_q = torch.log_softmax(student / temperature, dim=-1)
    log_p = torch.log_softmax(teacher / temperature, dim=-1)
    p = log_p.exp()
    losses = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1) * temperature ** 2
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / max(losses.numel(), 1)


def _exact_distillation_loss(student, teacher, temperature, reduction):
    """The same divergence as a sum of non-negative terms, q_j * h(w_j) with w = log p - log q
    and h(w) = 1 - e^w (1 - w) (the terms p log(p / q) - p + q; the added -p + q sum to 0).
    Near-equal distributions make the plain sum cancel; this one does not, h taken from its
    series for small w."""
    log_q = _exact_log_softmax(student / temperature, dim=-1)
    log_p = _exact_log_softmax(teacher / temperature, dim=-1)
    w = log_p - log_q
    small = w.abs() < 0.5
    ws = torch.where(small, w, 0.0)
    series = sum(ws ** k * ((k - 1) / math.factorial(k)) for k in range(2, 26))
    large = torch.where(small, 0.0, w) * torch.exp(w) - torch.expm1(torch.where(small, 0.0, w))
    losses = (log_q.exp() * torch.where(small, series, large)).sum(-1) * temperature ** 2
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / max(losses.numel(), 1)


def draw_distillation_loss(d):
    dtype = d.dtype()
    classes = d.size(1, 3000, (2, 127, 128, 129, 2049))
    rows = tuple(d.size(0, 6, (1,)) for _ in range(d.size(0, 2)))
    scale = d.magnitude(30.0)
    d.tensor("student", (*rows, classes), dtype, scale=scale, expand_dims=range(len(rows)))
    d.tensor("teacher", (*rows, classes), dtype, scale=scale, grad=False,
             expand_dims=range(len(rows)))
    options = {"temperature": d.choice([1.0, 2.0, 0.5, 4.0]),
               "reduction": d.choice(["mean", "sum", "none"])}
    d.note(str(options))

    bad = [fuzz.grown("teacher", -1), fuzz.with_extra_dim("teacher")]
    return _loss_case("distillation_loss", f"classes={classes}", ("student", "teacher"),
                      _plain_distillation_loss, _exact_distillation_loss, options, dtype, bad)


test_fuzz_distillation_loss, test_fuzz_distillation_loss_bad_inputs = fuzz.tests(
    draw_distillation_loss, backends_for("distillation_loss"))


test_fuzz_cross_entropy, test_fuzz_cross_entropy_bad_inputs = fuzz.tests(draw_cross_entropy, backends_for("cross_entropy"))


test_fuzz_masked_lm_loss, test_fuzz_masked_lm_loss_bad_inputs = fuzz.tests(draw_masked_lm_loss, backends_for("masked_lm_loss"))
