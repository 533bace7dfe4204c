"""What the op tests share: which backends to test, on which device, at which shapes, and
how a kernel's results are compared with the reference.

Every op's test file takes the backend as a parameter and compares it with
fusedlm.ops.reference on the same inputs, at one of two shape sets (shape_set):

- "small": shapes of a few dozen rows that still reach every tile edge, vector width and
  path of the kernels. The cpu backend and the reference run only these, and so do the
  backends that imitate their GPU on the CPU (Triton's interpreter, the CUDA emulator),
  where every launch costs milliseconds. Compared with the reference in float64, element
  by element, with assert_close at the kernel dtype's tolerance (TOLERANCES): a wrong
  element anywhere fails.
- "real": BERT-base (32 x 128 tokens, hidden 768, FFN 3072, vocab 30522) and GPT-2 small
  (8 x 1024 tokens, vocab 50257) shapes, for the backends running natively on a GPU (the
  gpu-marked tests; they run the small shapes too). There outputs and gradients sum
  thousands of rounded terms, so an element's error grows with the sum's length and no
  per-element tolerance is both tight and safe; they are compared with the reference in
  float32 (exact enough against half-precision kernels' 1e-3 to 1e-2, and affordable at
  these sizes) by norm-wise relative error, assert_relative_error, at the kernel dtype's
  bound (MAX_RELATIVE_ERROR), after poison_memory so an element a kernel never writes
  reads NaN.
"""
import contextlib
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlm
from fusedlm.backends import _REGISTRY, KERNEL_BACKENDS
from fusedlm.backends import cuda as cuda_backend
from fusedlm.backends import triton as triton_backend
from fusedlm.ops._dropout import cpu_keep_mask

# Tolerances (atol, rtol) of a kernel's output in a dtype against a float64 reference
# (small shapes).
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 2e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}

# Largest norm-wise relative error against the float32 reference, by the kernel's dtype
# (real shapes).
MAX_RELATIVE_ERROR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# Marks of a test that only makes sense on a native GPU (poisoned memory, real shapes).
needs_cuda = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Tests of what the cuda kernels move and compute, counted by the CUDA emulator
# (fusedlm.backends.cuda.count_launches): they run with `pytest -m cuda` on its build.
needs_emulator = [pytest.mark.cuda,
                  pytest.mark.skipif(not cuda_backend.EMULATED, reason="needs the emulated cuda build")]


def gpu_test(test):
    """Marks a test that takes no backend parameter as needing a native GPU (needs_cuda)."""
    for mark in needs_cuda:
        test = mark(test)
    return test


# --- backends and devices ------------------------------------------------------------------------

def backend_device(backend: str) -> torch.device:
    """The device whose tensors a backend is tested on here: the CPU for the cpu backend, the
    backends of plain PyTorch (reference and torch) and the slow backends (which imitate a
    GPU there), else the GPU."""
    if backend in ("cpu", "reference", "torch") or slow_backend(backend):
        return torch.device("cpu")
    return torch.device("cuda")


def slow_backend(backend: str) -> bool:
    """Whether `backend` imitates its GPU on the CPU: triton in Triton's interpreter
    (TRITON_INTERPRET=1), one program at a time, or cuda on the CUDA emulator (a
    FUSEDLM_CUDA=emulate build), one CPU thread per CUDA thread. Every launch then costs
    milliseconds: its cases take fewer rows than the compiled backends'."""
    if backend == "triton":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return backend == "cuda" and cuda_backend.emulated()


def shape_set(backend: str) -> str:
    """"real" for a backend that runs natively on a GPU, "small" for the others: the cpu
    backend, the reference, Triton's interpreter and the emulated cuda build."""
    return "real" if backend_device(backend).type == "cuda" else "small"


def backends_for(op: str, shapes: str = "small"):
    """pytest params: every kernel backend that implements `op`, skipped where it cannot run.

    shapes="real": the backends whose shape set can be the real one (not the cpu backend),
    each marked gpu and skipped where it does not run natively on a CUDA device."""
    params = []
    for name in KERNEL_BACKENDS:
        if shapes == "real" and name == "cpu":
            continue
        backend = _REGISTRY[name]
        reason = backend.unavailable or (None if op in backend.kernels else f"no {op} kernel")
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        if shapes == "real":
            marks = list(needs_cuda) + marks
            if not reason and shape_set(name) != "real":
                marks.append(pytest.mark.skip(reason=f"{name} runs the small shapes here"))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def keep_mask(backend: str, seed, shape, p: float) -> torch.Tensor:
    """The dropout keep mask (bool, True = keep) `backend` draws for stream `seed`, on its
    test device; element order row-major over `shape`."""
    if backend == "cpu":
        return cpu_keep_mask(seed, shape, p)
    if backend == "triton":
        return triton_backend.keep_mask(seed, shape, p, backend_device(backend))
    if backend == "cuda":
        return cuda_backend.keep_mask(seed, shape, p, backend_device(backend))
    raise ValueError(f"no dropout stream known for backend {backend!r}")


def skip_if_refused(backend: str, op: str, *args, **kwargs) -> None:
    """Skips a case that `backend`'s limits refuse (e.g. the cuda kernels' dtypes and sizes):
    the automatic choice gives such calls to another backend."""
    try:
        fusedlm.explain(op, *args, backend=backend, **kwargs)
    except RuntimeError as error:
        pytest.skip(str(error))


def first_taken(backend: str, op: str, options, call):
    """The first of `options` whose call to `op`, call(option) -> (args, kwargs), `backend`'s
    limits take; skips the test when they take none. For a test that needs inputs a backend
    runs (the widest dtype it takes, say) without restating which ones those are."""
    refused = []
    for option in options:
        args, kwargs = call(option)
        try:
            fusedlm.explain(op, *args, backend=backend, **kwargs)
            return option
        except RuntimeError as error:
            refused.append(str(error))
    pytest.skip("; ".join(refused))


# --- inputs ----------------------------------------------------------------------------------------

def fresh(shape, dtype, device, scale=1.0, requires_grad=True):
    """New random inputs each call (never zeros), as a leaf tensor."""
    if torch.device(device).type == "cuda":  # drawn on the GPU: real shapes are large
        t = (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)
    else:
        t = (torch.randn(shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


def as_reference(*tensors, dtype=torch.float64):
    """Leaf copies of the inputs in `dtype` (float64; float32 for the real shapes), for the
    reference."""
    return [None if t is None else t.detach().to(dtype).requires_grad_(t.requires_grad)
            for t in tensors]


def grads(outputs, inputs, upstream):
    """Gradients of `inputs` (None for absent ones) for `upstream` gradients of `outputs`."""
    present = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(outputs, present, upstream))
    return [None if t is None else next(got) for t in inputs]


def poison_memory():
    """Fills memory the caching allocator will hand out next with NaN, so an output element a
    kernel forgets to write shows up instead of reading as a plausible stale value (GPU)."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    blocks = [torch.full((min(free // 2, 8 << 30) // 4,), float("nan"), device="cuda")]
    # Small allocations come from their own pool of 2 MiB segments.
    blocks += [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(64)]
    torch.cuda.synchronize()
    del blocks


def subnormals_survive() -> bool:
    """Whether this thread's float arithmetic still gives subnormal results, as it does
    unless something left its flush-to-zero mode on."""
    return (torch.tensor([1e-38]) * 0.25).item() != 0.0


@contextlib.contextmanager
def leaves_float_mode_as_found(label: str):
    """Runs the block on one ATen thread, so that the cpu kernels run on the calling thread,
    then asserts that they left its floating-point mode as they found it (subnormal results
    survive; the kernels flush them only while they run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
        assert subnormals_survive(), f"{label}: the kernels left flush-to-zero on"
    finally:
        torch.set_num_threads(before)


# --- comparisons (see the module's docstring) -----------------------------------------------------

def assert_close(actual, expected, dtype=None, scale=1.0, name="output"):
    """Small shapes: element by element against a float64 reference, at the tolerance of
    `dtype` (default: actual's) times `scale`."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale,
                               msg=lambda m: f"{name}: {m}")


def assert_relative_error(actual, expected, dtype, name, bound=None):
    """Real shapes: ||actual - expected|| / ||expected|| against a float32 reference, within
    `bound`, by default the dtype's (NaN fails)."""
    actual, expected = actual.double(), expected.double()
    error = ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    bound = MAX_RELATIVE_ERROR[dtype] if bound is None else bound
    assert error <= bound, f"{name}: relative error {error:.3g} > {bound:g} ({dtype})"


class _Recording:
    """A mode that records the name of every function or op it sees (``ops``)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def _seen(self, func, args, kwargs):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Recorder(_Recording, TorchDispatchMode):
    """What a dispatch mode sees: the ops below autograd."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._seen(func, args, kwargs)


class FunctionRecorder(_Recording, TorchFunctionMode):
    """What a torch function mode sees: the functions and ops Python calls."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._seen(func, args, kwargs)
