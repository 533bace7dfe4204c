"""The randomized differential fuzzer every op's test file runs (its ``test_fuzz`` and
``test_fuzz_bad_inputs``).

Each case is drawn from one integer seed by the op's ``draw(d)``: shapes (edge sizes
often: 0, 1, odd widths, block edges), dtypes, layouts (contiguous, permuted, sliced
with an offset and a stride, expanded with stride 0; index tensors strided and offset)
and magnitudes. The op runs on the backend under test; its outputs and the gradients of
every leaf are compared with the same computation in plain PyTorch (the case's own
``reference``, written with torch's operators, independent of fusedlm) in float64.

The tolerance is the error plain PyTorch makes on the same computation at the case's
dtype (the same reference run in that dtype on the same inputs, and on those inputs moved
by one unit of rounding with the upstream gradients scaled: the largest of these errors,
as one run may round luckily; in float64, whose unmoved run is the truth unless the case
gives a more exact ``truth``, also float32's errors scaled by the ratio of the epsilons),
times ERROR_FACTOR, plus SLACK, as FlashAttention's tests measure their kernels. Errors
are relative per element, against ``|truth| + floor * max|truth|``: POINTWISE (1e-4) for
pointwise ops, whose every element must be accurate, 1 for outputs that sum many terms,
whose error scales with their largest element; never finer than the dtype's epsilon.

Bad inputs (the same draws, one argument made wrong) run in a child process, so that a
crash fails the test instead of ending the run; each must raise TypeError or ValueError
naming an argument of the op.

Budgets: FUSEDLM_FUZZ_CASES cases per op and backend (default 200; `make fuzz` runs
2,000). A failure prints the line that replays the case alone (FUSEDLM_FUZZ_CASE).
"""
import dataclasses
import importlib.util
import inspect
import json
import os
import random
import subprocess
import sys
from typing import Callable, Optional

import pytest
import torch

import fusedlm
from fusedlm.dtypes import FLOATS
from helpers import backend_device

CASES = int(os.environ.get("FUSEDLM_FUZZ_CASES", "200"))
ONE_CASE = os.environ.get("FUSEDLM_FUZZ_CASE")
DRAWS_PER_CASE = 50  # the most draws per case run: a backend must take at least 1 in 50
ERROR_FACTOR = 32.0
# Allowed on top, relative: the rounding noise of the float32 sums the kernels accumulate
# in (float64 ones for float64), which a gradient that is zero by symmetry (the keys of a
# one-key sequence) shows where plain PyTorch happens to compute an exact zero; for the
# halves, two units of their own rounding (a sum of rounded elements, as an expanded
# input's gradient is).
SLACK = {torch.float64: 64 * torch.finfo(torch.float64).eps,
         torch.float32: 32 * torch.finfo(torch.float32).eps,
         torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
         torch.float16: 2 * torch.finfo(torch.float16).eps}
JITTERED_RUNS = 2  # plain-PyTorch runs on moved inputs and scaled upstream gradients
# An absolute difference too small to matter: the inputs drawn are at least 1e-3 in scale,
# and below this lie only terms that underflowed (kernels may flush subnormals to zero, as
# GPUs do) or the rounding noise of gradients that are zero by symmetry (v constant over
# the keys leaves q no gradient).
NEGLIGIBLE = 1e-30
ZERO = 1e-12  # a tensor no element of which is larger is zero but for float64's rounding


@dataclasses.dataclass
class Case:
    """A drawn call of ``fusedlm.ops.<op>``. ``t`` maps each argument's name to its tensor:
    ``arguments(t)`` gives the op's (args, kwargs), ``reference(t)`` the outputs plain
    PyTorch computes, and ``outputs(result, t)`` the op's in the same order (by default its
    result, as a tuple). ``floors`` gives each output's floor (see the module's
    docstring); the gradients take ``grad_floor``. ``truth(t)``, where given, computes
    the reference's outputs without the cancellation its plain formula has even in float64
    (a log-softmax near 0): the float64 truth is then its run, and plain PyTorch's float64
    run is measured against it like any other."""
    op: str
    description: str
    arguments: Callable
    reference: Callable
    floors: tuple
    grad_floor: object = 1.0
    dtype: torch.dtype = torch.float32
    differentiable: bool = True
    outputs: Optional[Callable] = None
    bad: tuple = ()  # (description, argument, corrupt(t) -> t): calls its validation refuses
    any_dtype: tuple = ()  # arguments of any dtype (pad's and unpad's data)
    truth: Optional[Callable] = None

    def call(self, t, backend: str, explain: bool = False):
        args, kwargs = self.arguments(t)
        if explain:
            return fusedlm.explain(self.op, *args, backend=backend, **kwargs)
        result = getattr(fusedlm.ops, self.op)(*args, backend=backend, **kwargs)
        if self.outputs is not None:
            return self.outputs(result, t)
        return result if isinstance(result, tuple) else (result,)


class Draw:
    """The random choices of one case, all from its seed."""

    def __init__(self, seed: int, device: torch.device = torch.device("cpu")):
        self.rng = random.Random(seed)
        # Values are drawn on the CPU, the same for a seed on every device, then placed on
        # the device of the backend under test.
        self.generator = torch.Generator().manual_seed(seed)
        self.device = device
        self.leaves = {}  # name -> (leaf, view function, requires grad)
        self.index = {}   # name -> index tensor (any layout)
        self.notes = []
        self.extreme = False
        self.summed = set()  # leaves whose gradient is a sum: expanded ones

    # --- choices ---------------------------------------------------------------------------------
    def choice(self, options):
        return self.rng.choice(list(options))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def size(self, low: int, high: int, edges=()) -> int:
        """An int in [low, high], often an edge: low, high, or one of ``edges`` in range."""
        if self.chance(0.35):
            return self.choice([s for s in (low, high, *edges) if low <= s <= high])
        return self.rng.randint(low, high)

    def dtype(self, options=FLOATS) -> torch.dtype:
        return self.choice(options)

    def magnitude(self, extreme: float = 1e3) -> float:
        """Mostly 1; sometimes tiny or ``extreme``. An extreme case's gradients are held to
        being finite where the truth is, not to its digits: a saturated softmax leaves them
        rounding noise of the scores' size times epsilon, which plain PyTorch avoids only by
        recomputing the scores exactly as its forward did."""
        scale = self.choice([1.0, 1.0, 1.0, 1e-3, extreme])
        self.extreme = self.extreme or scale == extreme
        return scale

    # --- tensors ---------------------------------------------------------------------------------
    def tensor(self, name: str, shape, dtype, *, scale: float = 1.0, offset: float = 0.0,
               grad: bool = True, layouts=("contiguous", "permuted", "sliced", "expanded"),
               expand_dims=None):
        """A float input of ``shape`` in a random layout, values offset + scale * N(0, 1).
        "expanded" repeats one of ``expand_dims`` (default any) with stride 0."""
        shape = tuple(shape)
        layout = self.choice(layouts)
        expandable = [d for d in (range(len(shape)) if expand_dims is None else expand_dims)
                      if shape[d] > 1]
        if layout == "expanded" and not expandable:
            layout = "contiguous"
        if layout == "permuted":
            order = list(range(len(shape)))
            self.rng.shuffle(order)
            inverse = [order.index(d) for d in range(len(shape))]
            stored = [shape[d] for d in order]
            view = lambda t, inverse=inverse: t.permute(inverse)
        elif layout == "sliced" and shape:
            dim = self.rng.randrange(len(shape))
            stored = list(shape)
            stored[dim] = 2 * shape[dim] + 1
            index = (slice(None),) * dim + (slice(1, None, 2),)
            view = lambda t, index=index: t[index]
        elif layout == "expanded":
            dim = self.choice(expandable)
            stored = list(shape)
            stored[dim] = 1
            view = lambda t, shape=shape: t.expand(shape)
        else:
            layout, stored, view = "contiguous", list(shape), (lambda t: t)
        values = torch.randn(stored, dtype=torch.float64, generator=self.generator) * scale + offset
        self.leaves[name] = (values.to(self.device, dtype), view, grad)
        if layout == "expanded":  # its gradient sums over the expanded dimension
            self.summed.add(name)
        self.notes.append(f"{name}{list(shape)}:{layout}")
        return name

    def index_tensor(self, name: str, values: torch.Tensor,
                     layouts=("contiguous", "strided", "offset")):
        """An index tensor holding ``values`` in a random layout."""
        layout = self.choice(layouts) if values.dim() else "contiguous"
        values = values.to(self.device)
        flat = values.reshape(-1)
        if layout == "strided":
            if values.dim() == 1:
                buffer = values.new_zeros(2 * values.numel())
                buffer[::2] = values
                tensor = buffer[::2]
            else:  # every other column of a wider buffer
                buffer = values.new_zeros(*values.shape[:-1], 2 * values.shape[-1])
                buffer[..., ::2] = values
                tensor = buffer[..., ::2]
        elif layout == "offset":
            buffer = values.new_empty(values.numel() + 3)
            buffer[3:] = flat
            tensor = buffer[3:].view(values.shape)
        elif layout == "transposed" and values.dim() == 2:
            tensor = values.t().contiguous().t()
        else:
            layout, tensor = "contiguous", values.contiguous()
        self.index[name] = tensor
        self.notes.append(f"{name}{list(values.shape)}:{layout}")
        return name

    def note(self, text: str):
        self.notes.append(text)


# --- running a case ------------------------------------------------------------------------------

def _inputs(d: Draw, dtype: Optional[torch.dtype], jitter: Optional[torch.Generator] = None):
    """Fresh leaves (in ``dtype``; their own dtype when None) and the views the op takes.
    With a ``jitter`` generator, each element moves one unit of rounding up or down, at
    random."""
    leaves, views = {}, {}
    for name, (values, view, grad) in d.leaves.items():
        leaf = values.to(dtype or values.dtype).clone()
        if jitter is not None:
            up = (torch.rand(leaf.shape, generator=jitter) < 0.5).to(leaf.device)
            leaf = torch.nextafter(leaf, torch.where(up, float("inf"), float("-inf")).to(leaf.dtype))
        leaf.requires_grad_(grad)
        leaves[name] = leaf
        views[name] = view(leaf)
    views.update(d.index)
    return leaves, views


def _run(case: Case, d: Draw, dtype, function, upstream_seed: int, jitter=None):
    """Outputs and leaf gradients of ``function`` on inputs in ``dtype``, for upstream
    gradients drawn from ``upstream_seed``; ``jitter`` moves the inputs by one unit of
    rounding (see _inputs) and scales the upstream gradients."""
    leaves, views = _inputs(d, dtype, jitter)
    with torch.set_grad_enabled(case.differentiable):
        outputs = function(views)
    outputs = [o for o in outputs]
    wanted = [n for n, leaf in leaves.items() if leaf.requires_grad]
    if not case.differentiable or not wanted:
        return [o.detach() for o in outputs], {}
    differentiable = [o for o in outputs if o.requires_grad]
    # Every run gets the same upstream values, those of the case's dtype: the float64 truth
    # is the exact gradient for what the op under test receives, not for values it never
    # sees (a float16 dc that nearly cancels dh * o * tanh'(c) moves dc_prev by percents).
    generator = torch.Generator().manual_seed(upstream_seed)
    rounding = case.dtype if case.dtype.is_floating_point else torch.float64
    # A jittered run scales the upstream gradients by a random factor near 1 and divides
    # the gradients it gets by it (they are linear in the upstream): where the inputs are far
    # finer than what the op rounds (logits of 1e-3 whose probabilities are near 0.5, the
    # gradient their small difference), moving the inputs leaves every run the same rounding
    # luck, which was seen to make plain PyTorch 100 times more exact than at other upstreams.
    factor = 1.0
    if jitter is not None:
        factor = 2.0 ** (torch.rand((), dtype=torch.float64, generator=jitter).item() / 2 - 0.25)
    upstream = [(torch.randn(o.shape, dtype=torch.float64, generator=generator).to(rounding)
                 * factor).to(rounding).to(o.device, o.dtype) for o in differentiable]
    got = torch.autograd.grad(differentiable, [leaves[n] for n in wanted], upstream,
                              allow_unused=True)
    grads = {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(wanted, got)}
    if factor != 1.0:
        grads = {n: g.double() / factor for n, g in grads.items()}
    return [o.detach() for o in outputs], grads


def relative_error(x: torch.Tensor, truth: torch.Tensor, floor: float) -> float:
    """max |x - truth| / (|truth| + floor * max|truth|) (max|truth| at least 1 for a
    pointwise floor or a truth that is ZERO), ignoring differences below NEGLIGIBLE; inf
    where one is not finite and the other differs."""
    x, truth = x.double().cpu(), truth.double().cpu()
    if x.shape != truth.shape:
        return float("inf")
    if truth.numel() == 0:
        return 0.0
    same = (x == truth) | (x.isnan() & truth.isnan())
    finite = truth.isfinite()
    # Pointwise, at least 1: an element near a root of its function (gelu' at -0.75) is
    # judged against the function's natural scale even where it is the tensor's largest.
    largest = truth[finite].abs().max().item() if finite.any() else 0.0
    # A tensor zero to float64's rounding is zero by symmetry (the queries of one-key
    # sequences have no gradient): it is judged in absolute terms, as is a pointwise one.
    scale = max(largest, 1.0) if floor < 1 or largest < ZERO else largest
    denominator = truth.abs() + floor * scale + torch.finfo(torch.float64).tiny
    difference = ((x - truth).abs() - NEGLIGIBLE).clamp(min=0)
    error = torch.where(same, torch.zeros_like(x), difference / denominator)
    error = torch.where(error.isnan(), torch.full_like(error, float("inf")), error)
    return error.max().item()


def _rounded_range(truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """truth with the values past ``dtype``'s largest finite one made infinite, as rounding
    them to ``dtype`` does."""
    if not dtype.is_floating_point:
        return truth
    largest = torch.finfo(dtype).max
    return torch.where(truth.abs() > largest, truth.sign() * float("inf"), truth)


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def check_case(case: Case, d: Draw, backend: str):
    """Compares the op on ``backend`` with the float64 reference; returns the failures."""
    upstream = d.rng.randrange(2**31)
    outputs, grads = _run(case, d, None, lambda t: case.call(t, backend), upstream)
    truth, truth_grads = _run(case, d, torch.float64, case.truth or case.reference, upstream)
    # Where one rounding dominates an error (a row's mean, a cell's sum that cancels), a
    # single run of plain PyTorch may round luckily: its error is taken as the largest of
    # that run and of runs on inputs moved by one unit of rounding (JITTERED_RUNS).
    jitter = torch.Generator().manual_seed(upstream)
    plain = [_run(case, d, None, case.reference, upstream, jitter) for _ in range(JITTERED_RUNS)]
    if case.dtype != torch.float64 or case.truth:
        plain.append(_run(case, d, None, case.reference, upstream))
    # In float64 the unmoved run is usually the truth, and moved inputs miss the rounding
    # inside the computation: the same runs in float32, their errors scaled by the epsilons'
    # ratio, measure it (float32 kept as many digits, in proportion, of a sum that cancels).
    plain32 = []
    if case.dtype == torch.float64:
        plain32 = [_run(case, d, torch.float32, case.reference, upstream, jitter)
                   for _ in range(JITTERED_RUNS)]
        plain32.append(_run(case, d, torch.float32, case.reference, upstream))
    shrink = _ulp(torch.float64) / _ulp(torch.float32)
    failures = []

    def compare(name, got, want, low, low32, floor):
        want = _rounded_range(want, got.dtype)
        if d.extreme and name.startswith("grad"):
            if not (got.isfinite() | ~want.isfinite()).all():
                failures.append(f"{name}: not finite where the truth is")
            return
        # No element is resolved more finely than the dtype's own rounding of its terms.
        floor = max(floor, _ulp(case.dtype))
        error = relative_error(got, want, floor)
        plain_error = max([relative_error(one, want, floor) for one in low] +
                          [shrink * relative_error(one, want, floor) for one in low32])
        allowed = ERROR_FACTOR * plain_error + SLACK[case.dtype]
        if not error <= allowed:
            failures.append(f"{name}: error {error:.3g} > {allowed:.3g} (plain PyTorch's "
                            f"{plain_error:.3g}, x {ERROR_FACTOR:g} + slack)")

    for i, (got, want, floor) in enumerate(zip(outputs, truth, case.floors)):
        compare(f"output {i}", got, want, [outs[i] for outs, _ in plain],
                [outs[i] for outs, _ in plain32], floor)
    for name in truth_grads:
        floor = case.grad_floor.get(name, 1.0) if isinstance(case.grad_floor, dict) else case.grad_floor
        if name in d.summed:
            floor = 1.0
        compare(f"grad {name}", grads.get(name), truth_grads[name], [g[name] for _, g in plain],
                [g[name] for _, g in plain32], floor)
    return failures


def _refused(case: Case, backend: str) -> Optional[str]:
    """Why ``backend`` does not take the case (its declared limits), or None."""
    _leaves, views = _inputs(case._draw, None)
    try:
        case.call(views, backend, explain=True)
    except RuntimeError as error:
        return str(error)
    return None


def _taken(draw: Callable[[Draw], Case], backend: str, seeds, cases: int):
    """(seed, case) for each of the first ``cases`` draws from ``seeds`` that the backend
    takes (refused draws do not count), its tensors on the backend's device."""
    taken = 0
    for seed in seeds:
        if taken == cases:
            return
        d = Draw(seed, backend_device(backend))
        case = draw(d)
        case._draw = d
        if not _refused(case, backend):
            taken += 1
            yield seed, case


def run(draw: Callable[[Draw], Case], backend: str, test_id: str, cases: int = CASES):
    """``cases`` cases the backend takes (refused draws do not count); raises AssertionError
    listing every failing case with its reproduction."""
    base = random.SystemRandom().randrange(2**31)
    # A backend that takes few draws (the cuda attention: halves, head dims 64 and 128, no
    # bias; about one in seven) is drawn for until it has run ``cases`` of them.
    seeds = [int(ONE_CASE)] if ONE_CASE else [base + i for i in range(cases * DRAWS_PER_CASE)]
    wanted = 1 if ONE_CASE else cases
    taken, failures = 0, []
    for seed, case in _taken(draw, backend, seeds, wanted):
        d = case._draw
        taken += 1
        try:
            found = check_case(case, d, backend)
        except Exception as error:  # an exception on a valid input is a failure too
            found = [f"raised {type(error).__name__}: {str(error)[:300]}"]
        if found:
            failures.append(f"FUSEDLM_FUZZ_CASE={seed} pytest '{test_id}'  # {case.description}; "
                            f"{' '.join(d.notes)}: {'; '.join(found)}")
    assert taken == wanted, (f"{backend} took {taken} of {len(seeds)} drawn cases, not {wanted}: "
                             f"draw more of what it takes")
    assert not failures, f"{len(failures)} of {taken} cases failed:\n" + "\n".join(failures[:20])
    return taken


# --- bad inputs ----------------------------------------------------------------------------------

def _corruptions(case: Case, d: Draw):
    """(description, argument, views) for each tensor argument of the case in a wrong
    dtype: an integer one for float tensors, float32 for index tensors."""
    for name in list(d.leaves) + list(d.index):
        if name in case.any_dtype:
            continue
        views = _inputs(d, None)[1]
        t = views[name]
        wrong = torch.int32 if t.is_floating_point() else torch.float32
        yield f"{name} as {wrong}", name, {**views, name: t.detach().to(wrong)}


def grown(name: str, dim: int):
    """A corruption for a case's ``bad`` list: ``name`` one longer in ``dim``."""
    def corrupt(t):
        x = t[name].detach()
        return {**t, name: torch.cat([x, x.narrow(dim, 0, 1) if x.shape[dim] else
                                      x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1:]))], dim)}
    return f"{name} dim {dim} + 1", name, corrupt


def with_extra_dim(name: str):
    """A corruption: ``name`` with one more leading dimension."""
    return f"{name} with an extra dim", name, lambda t: {**t, name: t[name].detach()[None]}


def replaced(name: str, value, description: str):
    """A corruption: ``name`` replaced by ``value`` (a tensor, placed on the case's device,
    or a plain value)."""
    def corrupt(t):
        moved = value.to(t[name].device) if isinstance(value, torch.Tensor) else value
        return {**t, name: moved}
    return description, name, corrupt


def child_main(module_path: str, function: str, backend: str, seed: int, cases: int):
    """In the child: runs the bad inputs of ``cases`` cases the backend takes (drawing as
    ``run`` does), printing a JSON line per input before and after its call (a crash leaves
    the last 'before' line), and last the number of cases taken."""
    spec = importlib.util.spec_from_file_location("fuzzed_module", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    draw = getattr(module, function)
    taken = 0
    seeds = range(seed, seed + cases * DRAWS_PER_CASE)
    for case_seed, case in _taken(draw, backend, seeds, cases):
        d = case._draw
        taken += 1
        attempts = list(_corruptions(case, d)) + [(desc, name, mutate(_inputs(d, None)[1]))
                                            for desc, name, mutate in case.bad]
        for description, name, views in attempts:
            print(json.dumps({"start": f"{case.description} | {description}", "seed": case_seed}),
                  flush=True)
            try:
                with torch.no_grad():
                    case.call(views, backend)
                result = {"raised": None}
            except (TypeError, ValueError) as error:
                result = {"raised": type(error).__name__, "message": str(error), "argument": name}
            except Exception as error:
                result = {"raised": type(error).__name__, "message": str(error)[:300],
                          "argument": name, "unclear": True}
            print(json.dumps(result), flush=True)
    print(json.dumps({"taken": taken}), flush=True)


def run_bad_inputs(draw: Callable[[Draw], Case], backend: str, test_id: str, cases: int = 20):
    """The bad inputs of ``cases`` cases of ``draw`` (a function of a test file): every
    tensor argument in a wrong dtype, and each case's own ``bad`` list, in a child process.
    Every one must raise TypeError or ValueError naming an argument of the op; a crash of
    the child fails with its last input. On a GPU the child runs under FUSEDLM_DEBUG=1, the
    mode that checks the values of every index tensor there (fusedlm.backends.check_index_data)."""
    test_file, function = draw.__code__.co_filename, draw.__name__
    case = draw(Draw(0))
    arguments = [a for a in inspect.signature(getattr(fusedlm.ops, case.op)).parameters
                 if a != "backend"]
    seed = int(ONE_CASE) if ONE_CASE else random.SystemRandom().randrange(2**31)
    debug = {"FUSEDLM_DEBUG": "1"} if backend_device(backend).type != "cpu" else {}
    child = subprocess.run(
        [sys.executable, __file__, test_file, function, backend, str(seed), str(cases)],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, **debug, "PYTHONPATH": os.pathsep.join(filter(None, [
            os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))})
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    problems, current, taken = [], None, None
    for line in lines:
        if "taken" in line:
            taken = line["taken"]
            continue
        if "start" in line:
            current = line
            continue
        where = f"FUSEDLM_FUZZ_CASE={current['seed']} pytest '{test_id}'  # {current['start']}"
        if line["raised"] is None:
            problems.append(f"{where}: accepted")
        elif line.get("unclear"):
            problems.append(f"{where}: {line['raised']} ({line['message']})")
        elif not any(a in line["message"] for a in arguments):
            problems.append(f"{where}: message names no argument: {line['message']}")
    if child.returncode != 0:
        last = lines[-1] if lines and "start" in lines[-1] else current
        problems.append(f"child exited with {child.returncode} during "
                        f"{last and last['start']} (seed {last and last['seed']}): "
                        f"{child.stderr[-1500:]}")
    elif not taken:
        problems.append(f"{backend} took none of the cases drawn: draw more of what it takes")
    assert not problems, f"{len(problems)} bad inputs not refused clearly:\n" + "\n".join(problems[:20])


def tests(draw: Callable[[Draw], Case], backends):
    """The two tests of an op's fuzzer, over the pytest params ``backends``: its cases
    (run) and its bad inputs (run_bad_inputs). A test file binds them to its own names."""
    @pytest.mark.parametrize("backend", backends)
    def test_cases(backend, request):
        run(draw, backend, request.node.nodeid)

    @pytest.mark.parametrize("backend", backends)
    def test_bad_inputs(backend, request):
        run_bad_inputs(draw, backend, request.node.nodeid)

    return test_cases, test_bad_inputs


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))


# --- references several fuzzers share --------------------------------------------------------------

# The floor of an output each of whose elements is its own function: every element is
# held to its own relative error, down to 1e-4 of the largest.
POINTWISE = 1e-4


def kv_heads(d, heads):
    """Key/value heads for q's ``heads``, drawn with ``d``: mostly as many; often a divisor
    of them (grouped-query, or multi-query at 1)."""
    if heads == 1 or d.chance(0.6):
        return heads
    return d.choice([n for n in range(1, heads) if heads % n == 0])


def softmax_attention(q, k, v, *, causal=False, key_padding_mask=None, attn_bias=None, scale=None,
                      window_size=(-1, -1)):
    """softmax(q k^T * scale + bias) v over [..., seq, head_dim], computed in q's dtype; rows
    that see no key are zeros. k and v may have fewer heads (dim -3) than q: each serves a
    group of consecutive query heads. Causal and window_size (left, right; -1 unbounded)
    align to the bottom right: query i sees key j when i + off - left <= j <= i + off + right,
    off = seq_k - seq_q.

    Below float64 (plain PyTorch's error, against which kernels are measured) the
    probabilities are exp(scores - logsumexp(scores)), as FlashAttention's backward forms
    them: with large scores, the rounding of the log-sum-exp (|lse| ulp) is the error of
    every probability of its row. In float64 (the truth) they are softmax's."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    if q.dim() > 2 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if attn_bias is not None:
        scores = scores + attn_bias
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device)
    left, right = window_size
    if causal:
        allowed = torch.tril(allowed, diagonal=seq_k - seq_q)
    if right >= 0:
        allowed = torch.tril(allowed, diagonal=seq_k - seq_q + right)
    if left >= 0:
        allowed = torch.triu(allowed, diagonal=seq_k - seq_q - left)
    allowed = allowed.expand(scores.shape)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sees_a_key = allowed.any(dim=-1, keepdim=True)
    if q.dtype == torch.float64:  # the truth: the most accurate form
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    probs = torch.where(sees_a_key, probs, torch.zeros_like(scores))
    return torch.matmul(probs, v)
