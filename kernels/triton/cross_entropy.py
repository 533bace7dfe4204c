"""cross_entropy, distillation_loss and masked_lm_loss in Triton.

One program per row of logits. A first sweep over the classes in blocks keeps an
online log-sum-exp (running max and the sum of exponentials rescaled to it), so a row
of any vocabulary size is read once; with label smoothing it also sums the logits.
With a gradient wanted, a second sweep writes (softmax - target) * scale over the
row: the gradient comes out of the forward pass, and the backward only rescales it.
Rows labelled ignore_index get a zero loss and gradient. Traffic: two reads of the
logits and one write of the gradient.

distillation_loss works the same way on a student and a teacher row at once: a first
sweep keeps both online log-sum-exps, a second forms log p and log q from the shifted
logits, sums the divergence (_divergence_term: without cancellation) and writes the
gradient.

masked_lm_loss gathers the labelled rows and projects them chunk_rows at a time with
torch's matrix product; the kernel overwrites each chunk's logits with their gradient
in place, which torch's products then fold into d_hidden and d_weight before the next
chunk. Only one chunk of logits ever exists.
"""
import torch
import triton
import triton.language as tl

from ._common import autotune, rows_of


def _configs():
    return [triton.Config({"BLOCK": b}, num_warps=w)
            for b, w in ((4096, 8), (8192, 16), (2048, 4), (16384, 16))]


@autotune(_configs(), key=["C", "WITH_GRAD"])
@triton.jit
def _cross_entropy_kernel(LOGITS, LABELS, LOSS, GRAD, SCALE, ROW_SCALE, C, ignore_index,
                          smoothing, WITH_GRAD: tl.constexpr, SMOOTHING: tl.constexpr,
                          HAS_ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * C
    cols = tl.arange(0, BLOCK)
    running_max = -float("inf")
    sum_exp = 0.0
    sum_logits = 0.0
    for start in range(0, C, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < C, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # A block of -inf logits (masked classes) leaves the max at -inf: shift by 0 then.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        sum_exp = sum_exp * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
        if SMOOTHING:
            sum_logits += tl.sum(tl.where(start + cols < C, x, 0.0), axis=0)
    log_sum = tl.log(sum_exp)
    lse = running_max + log_sum

    label = tl.load(LABELS + row)
    ignored = label == ignore_index
    valid = (label >= 0) & (label < C)
    target = tl.load(base + label, mask=valid & ~ignored, other=0.0).to(tl.float32)
    # Sums of non-negative parts: lse - target would keep only lse's rounding of a small loss.
    loss = log_sum + (1.0 - smoothing) * (running_max - target)
    if SMOOTHING:
        loss += smoothing * (running_max - sum_logits / C)
    # A label out of range (unchecked only while compiling or capturing a CUDA graph) shows
    # as a NaN loss rather than a wrong read.
    loss = tl.where(ignored, 0.0, tl.where(valid, loss, float("nan")))
    tl.store(LOSS + row, loss)

    if WITH_GRAD:
        scale = tl.load(SCALE)
        if HAS_ROW_SCALE:
            scale *= tl.load(ROW_SCALE + row)
        for start in range(0, C, BLOCK):
            mask = start + cols < C
            x = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(start + cols == label, 1.0 - smoothing, 0.0)
            if SMOOTHING:
                g -= smoothing / C
            g = tl.where(ignored, 0.0, g * scale)
            tl.store(GRAD + row * C + start + cols, g.to(GRAD.dtype.element_ty), mask=mask)


def _run(logits2, labels1, losses, grad, scale, row_scale, ignore_index, label_smoothing):
    """Writes the per-row losses (float32, rows contiguous elements of any shape) of logits2
    [rows, classes]; with grad (contiguous, possibly logits2 itself), writes
    scale * row_scale[row] * d(loss_row)/d(logits) into it. scale is a one-element float32
    tensor (read on the device: no synchronisation)."""
    rows, classes = logits2.shape
    if rows:
        _cross_entropy_kernel[(rows,)](
            logits2, labels1, losses, grad, scale, row_scale, classes, ignore_index,
            float(label_smoothing), WITH_GRAD=grad is not None, SMOOTHING=label_smoothing > 0,
            HAS_ROW_SCALE=row_scale is not None)


@triton.jit
def _scale_kernel(X, OUT, SCALE, n, cols, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if PER_ROW:
        scale = tl.load(SCALE + offsets // cols, mask=mask, other=0.0)
    else:
        scale = tl.load(SCALE)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, (x * scale).to(OUT.dtype.element_ty), mask=mask)


def _scaled(t, scale):
    """t * scale rounded once to t's dtype; scale (float32) holds one value, or one per row
    of t viewed as [scale.numel(), -1]."""
    t = t.contiguous()
    out = torch.empty_like(t)
    if t.numel():
        per_row = scale.numel() > 1
        cols = t.numel() // scale.numel() if per_row else 1
        _scale_kernel[(triton.cdiv(t.numel(), 4096),)](t, out, scale, t.numel(), cols,
                                                       PER_ROW=per_row, BLOCK=4096)
    return out


def _unit_scale(device, value=1.0):
    return torch.full((), value, dtype=torch.float32, device=device)


def _reduce(losses, reduction, labelled):
    """The loss of a reduction from per-row losses; labelled: the count (a tensor or int)."""
    if reduction == "sum":
        return losses.sum(dtype=torch.float64).float()
    count = labelled.clamp(min=1) if isinstance(labelled, torch.Tensor) else max(labelled, 1)
    return (losses.sum(dtype=torch.float64) / count).float()


# --- distillation_loss ---------------------------------------------------------------------------

@triton.jit
def _online_lse(x, running_max, sum_exp):
    """The running (max, sum of exp(x - max)) with a block x merged in; a block of -inf
    leaves the max at -inf (shifted by 0 then)."""
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    return new_max, sum_exp * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)


@triton.jit
def _divergence_term(p, q, w):
    """Class j's term of KL(p || q) as q * h(w), w = log p - log q, h(w) = 1 - e^w (1 - w)
    (p log(p / q) - p + q over q; the -p + q sum to 0): every term >= 0, so close
    distributions do not cancel, and a constant error in w moves the sum only in
    proportion. Near 0, h is its series, sum over k >= 2 of (k - 1) / k! * w^k; a class
    the teacher rules out (p = 0) adds q."""
    poly = 0.5 + w * (1 / 3 + w * (1 / 8 + w * (1 / 30 + w * (1 / 144 + w * (1 / 840 + w * (
        1 / 5760 + w * (1 / 45360 + w * (1 / 403200 + w * (1 / 3991680 + w * (11 / 479001600))))))))))
    term = tl.where((w < 0.25) & (w > -0.25), q * w * w * poly, q - p * (1.0 - w))
    return tl.where(p > 0.0, term, q)


# Two rows in flight: blocks of 16384 spill registers on sm_90 (scripts/triton_compile_check.py).
@autotune([c for c in _configs() if c.kwargs["BLOCK"] < 16384], key=["C", "WITH_GRAD"])
@triton.jit
def _distillation_kernel(STUDENT, TEACHER, LOSS, GRAD, SCALE, C, inv_t, WITH_GRAD: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    max_q, sum_q = -float("inf"), 0.0
    max_p, sum_p = -float("inf"), 0.0
    for start in range(0, C, BLOCK):
        mask = start + cols < C
        x = tl.load(STUDENT + row * C + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.load(TEACHER + row * C + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        max_q, sum_q = _online_lse(x * inv_t, max_q, sum_q)
        max_p, sum_p = _online_lse(y * inv_t, max_p, sum_p)
    # log q = (x / T - max) - log(sum): the shift first, as log_softmax does, so that a class
    # near the max keeps its digits.
    log_zq = tl.log(sum_q)
    log_zp = tl.log(sum_p)
    scale = tl.load(SCALE) / inv_t
    kl = 0.0
    for start in range(0, C, BLOCK):
        mask = start + cols < C
        x = tl.load(STUDENT + row * C + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(TEACHER + row * C + start + cols, mask=mask, other=0.0).to(tl.float32)
        log_q = (x * inv_t - max_q) - log_zq
        log_p = (y * inv_t - max_p) - log_zp
        p = tl.exp(log_p)
        q = tl.exp(log_q)
        kl += tl.sum(tl.where(mask, _divergence_term(p, q, log_p - log_q), 0.0), axis=0)
        if WITH_GRAD:
            g = scale * (q - p)
            tl.store(GRAD + row * C + start + cols, g.to(GRAD.dtype.element_ty), mask=mask)
    tl.store(LOSS + row, kl / (inv_t * inv_t))


def distillation_loss_forward(student_logits, teacher_logits, temperature, reduction, with_grad):
    x, y = rows_of(student_logits), rows_of(teacher_logits)
    rows, classes = x.shape
    scale = _unit_scale(x.device, 1.0 / max(rows, 1) if reduction == "mean" else 1.0)
    grad = student_logits.new_empty(student_logits.shape) if with_grad else None
    losses = torch.empty(student_logits.shape[:-1], dtype=torch.float32, device=x.device)
    if rows:
        _distillation_kernel[(rows,)](x, y, losses, grad, scale, classes, 1.0 / temperature,
                                      WITH_GRAD=with_grad)
    loss = losses if reduction == "none" else _reduce(losses, reduction, rows)
    return loss, grad if with_grad else student_logits.new_empty(0)


# --- cross_entropy -------------------------------------------------------------------------------

def cross_entropy_forward(logits, labels, ignore_index, label_smoothing, reduction, with_grad):
    x = rows_of(logits)
    y = labels.contiguous().view(-1)
    labelled = (y != ignore_index).sum()
    if reduction == "mean":
        scale = 1.0 / labelled.clamp(min=1).to(torch.float32)
    else:
        scale = _unit_scale(x.device)
    # In the inputs' shapes, not views of [rows] and [rows, classes] results: FSDP2 cannot
    # follow in-place changes to a view a module returns.
    grad = logits.new_empty(logits.shape) if with_grad else None
    losses = torch.empty(labels.shape, dtype=torch.float32, device=x.device)
    _run(x, y, losses, grad, scale, None, ignore_index, label_smoothing)
    loss = losses if reduction == "none" else _reduce(losses, reduction, labelled)
    return loss, grad if with_grad else logits.new_empty(0)


def cross_entropy_backward(grad, saved_grad, reduction):
    return _scaled(saved_grad, grad.to(torch.float32).contiguous())


# --- masked_lm_loss ------------------------------------------------------------------------------

def _project(h2, weight, bias, y, labelled, ignore_index, label_smoothing, chunk_rows, scale,
             row_scale, grads):
    """Losses (float32) of the labelled rows, projected chunk_rows at a time. grads: None
    (losses only), or [dhidden (in hidden's shape), dweight, dbias] (each None when not
    wanted) that each chunk's gradient is folded into."""
    n, vocab = labelled.numel(), weight.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=h2.device)
    if n == 0:
        return losses
    chunk = min(chunk_rows, n)
    buffer = h2.new_empty((chunk, vocab))
    weight_t = weight.t()
    for c0 in range(0, n, chunk):
        m = min(chunk, n - c0)
        rows = labelled[c0:c0 + m]
        h = h2.index_select(0, rows)
        logits = buffer[:m]
        if bias is not None:
            torch.addmm(bias, h, weight_t, out=logits)
        else:
            torch.mm(h, weight_t, out=logits)
        chunk_scale = row_scale.index_select(0, rows) if row_scale is not None else None
        _run(logits, y.index_select(0, rows), losses[c0:c0 + m], logits if grads else None, scale,
             chunk_scale, ignore_index, label_smoothing)
        if not grads:
            continue
        dhidden, dweight, dbias = grads
        # logits now holds the chunk's gradient.
        if dhidden is not None:
            dhidden.view(h2.shape).index_copy_(0, rows, logits @ weight)
        if dweight is not None:
            if c0 == 0:
                torch.mm(logits.t(), h, out=dweight)
            else:
                dweight.addmm_(logits.t(), h)
        if dbias is not None:
            dbias += logits.sum(0, dtype=torch.float32)
    return losses


def _mlm_grads(hidden, weight, bias, labelled, need_dhidden, need_dweight, need_dbias):
    dhidden = hidden.new_zeros(hidden.shape) if need_dhidden else None
    # Written whole by the first chunk's product; zeros when no row is labelled.
    dweight = None
    if need_dweight:
        dweight = torch.empty_like(weight) if labelled.numel() else torch.zeros_like(weight)
    dbias = None
    if need_dbias and bias is not None:
        dbias = torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device)
    return [dhidden, dweight, dbias]


def _grads_out(grads, weight, bias):
    """The gradients as the op returns them: one not computed is a new empty tensor (outputs
    of a custom op may not alias each other)."""
    dhidden, dweight, dbias = grads
    return (dhidden if dhidden is not None else weight.new_empty(0),
            dweight if dweight is not None else weight.new_empty(0),
            dbias.to(bias.dtype) if dbias is not None else weight.new_empty(0))


def _mlm_inputs(hidden, weight, bias, labels, ignore_index, chunk_rows):
    h2 = rows_of(hidden)
    y = labels.contiguous().view(-1)
    labelled = torch.nonzero(y != ignore_index).view(-1)
    return h2, weight.contiguous(), bias.contiguous() if bias is not None else None, y, labelled


def masked_lm_loss_forward(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction,
                           chunk_rows, need_dhidden, need_dweight, need_dbias):
    h2, w, b, y, labelled = _mlm_inputs(hidden, weight, bias, labels, ignore_index, chunk_rows)
    n = labelled.numel()
    # With reduction "none" grad_output weighs each row: the gradients wait for the backward.
    with_grads = reduction != "none" and (need_dhidden or need_dweight or need_dbias)
    grads = _mlm_grads(hidden, w, b, labelled, need_dhidden, need_dweight, need_dbias) if with_grads else None
    scale = _unit_scale(h2.device, 1.0 / max(n, 1) if reduction == "mean" else 1.0)
    losses = _project(h2, w, b, y, labelled, ignore_index, label_smoothing, chunk_rows, scale, None,
                      grads)
    if reduction == "none":
        loss = losses.new_zeros(labels.shape)
        loss.view(-1).index_copy_(0, labelled, losses)
    else:
        loss = _reduce(losses, reduction, n)
    return (loss, *_grads_out(grads or [None] * 3, weight, bias))


def masked_lm_loss_backward(grad, hidden, weight, bias, labels, dhidden, dweight, dbias,
                            ignore_index, label_smoothing, reduction, chunk_rows, need_dhidden,
                            need_dweight, need_dbias):
    scale = grad.to(torch.float32).contiguous()
    if reduction != "none":
        return _scaled(dhidden, scale), _scaled(dweight, scale), _scaled(dbias, scale)
    # Per-row grad_output: redo the chunks, each row's gradient scaled by its grad_output.
    h2, w, b, y, labelled = _mlm_inputs(hidden, weight, bias, labels, ignore_index, chunk_rows)
    grads = _mlm_grads(hidden, w, b, labelled, need_dhidden, need_dweight, need_dbias)
    _project(h2, w, b, y, labelled, ignore_index, label_smoothing, chunk_rows,
             _unit_scale(h2.device), scale.view(-1), grads)
    return _grads_out(grads, weight, bias)
