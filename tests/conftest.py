"""Shared test helpers: which backends to test, on which device, and tolerances.

Every op's test file takes the backend as a parameter and compares it with
fusedlm.ops.reference evaluated in float64 on the same inputs.
"""
import os
import sys
import types

import pytest
import torch


def _hypothesis_that_skips():
    """A stand-in for hypothesis where it is not installed (a bare GPU machine): its
    property tests skip, and the rest of their files still run."""
    module = types.ModuleType("hypothesis")
    module.given = lambda *a, **k: pytest.mark.skip(reason="hypothesis is not installed")
    module.settings = lambda *a, **k: (lambda test: test)
    module.strategies = types.SimpleNamespace(**{
        name: (lambda *a, **k: None) for name in
        ("integers", "floats", "booleans", "sampled_from", "lists", "tuples", "just")})
    return module


try:
    import hypothesis  # noqa: F401
except ImportError:
    sys.modules["hypothesis"] = _hypothesis_that_skips()
    sys.modules["hypothesis.strategies"] = sys.modules["hypothesis"].strategies

import fusedlm
from fusedlm.backends import _REGISTRY
from fusedlm.backends import cuda as cuda_backend
from fusedlm.backends import triton as triton_backend
from fusedlm.ops._dropout import cpu_keep_mask

# Tolerances (atol, rtol) of a kernel's output in a dtype against a float64 reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 2e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def backend_device(backend: str) -> torch.device:
    """The device whose tensors a backend is tested on here: the CPU for the cpu backend and
    for the slow backends (which imitate a GPU there), else the GPU."""
    if backend == "cpu" or slow_backend(backend):
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


def backends_for(op: str):
    """pytest params: every kernel backend that implements `op`, skipped where it cannot run."""
    params = []
    for name in ("cpu", "triton", "cuda"):
        backend = _REGISTRY[name]
        reason = backend.unavailable or (None if op in backend.kernels else f"no {op} kernel")
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
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


def assert_close(actual, expected, dtype=None, scale=1.0, name="output"):
    """Compares with a float64 reference at the tolerance of `dtype` (default: actual's)."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale,
                               msg=lambda m: f"{name}: {m}")


def fresh(shape, dtype, device, scale=1.0, requires_grad=True):
    """New random inputs each call (never zeros), as a leaf tensor."""
    t = (torch.randn(shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


def as_reference(*tensors):
    """float64 leaf copies of the inputs, for the reference."""
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


@pytest.fixture(params=fusedlm._C.supported_cpu_capabilities())
def cpu_isa(request):
    """Runs a test once per instruction set the processor supports."""
    before = fusedlm._C.cpu_capability()
    fusedlm._C.set_cpu_capability(request.param)
    yield request.param
    fusedlm._C.set_cpu_capability(before)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test draws new random inputs; pytest shows the printed seed when a test fails."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"torch.manual_seed({seed})")
    torch.manual_seed(seed)
    yield seed


def pytest_collection_modifyitems(items):
    """Marks every test that runs the triton or the cuda backend with its name, so that
    `TRITON_INTERPRET=1 pytest -m triton` runs just the triton ones, in the interpreter,
    and `pytest -m cuda` against a FUSEDLM_CUDA=emulate build the cuda ones, on the
    emulator (FUSEDLM_EMULATE_ARCH=sm_90a for Hopper's paths); both on CPU tensors."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend") if callspec is not None else None
        if backend in ("triton", "cuda"):
            item.add_marker(getattr(pytest.mark, backend))


@pytest.fixture
def one_thread():
    """Tiny models on busy cores: their ops take microseconds, and handing them to a second
    thread costs more than the work (several times over, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
