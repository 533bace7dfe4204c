"""Fixtures and pytest hooks of the tests (their shared helpers are in tests/helpers.py)."""
import os
import sys
import tempfile
import types

import pytest
import torch

# pytest-xdist's workers share the cores: each takes its share of torch's threads rather
# than all of them (the tests of threading set their own counts).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))

# Kernel checks at first use (fusedlm.verify) keep their results in a folder of
# the test run's own, read when fusedlm is imported: never the user's cache. The child
# processes the tests start inherit it; it is removed when the run ends.
if "FUSEDLM_CACHE_DIR" not in os.environ:
    _cache = tempfile.TemporaryDirectory(prefix="fusedlm-tests-")
    os.environ["FUSEDLM_CACHE_DIR"] = _cache.name
# On a GPU, automatic choices are timed at first use (fusedlm.verify.tuning): a test of
# which backend a call takes would then rest on the machine's measurements. The tests of
# the timing turn it on with a timer of their own.
os.environ.setdefault("FUSEDLM_TUNE", "0")


def _interpreter_rounds_bfloat16_to_nearest():
    """Triton's interpreter converts float32 to bfloat16 by truncation, where a GPU rounds
    to nearest even (as torch does). Truncated, every bfloat16 rounding in a kernel is up to
    a whole ulp and biased one way: near-cancelling gradients (attention's dq and dk on
    logits in the hundreds) come out several times less accurate than on a GPU, and a row
    of add_layer_norm whose two sums truncate to one value is normalised as constant.
    The tests run the kernels as a GPU would round them."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    truncating = getattr(interpreter, "_convert_float", None)
    if truncating is None:
        return

    def convert(values, from_dtype, to_dtype, rounding_mode):
        if from_dtype != tl.float32 or to_dtype != tl.bfloat16:
            return truncating(values, from_dtype, to_dtype, rounding_mode)
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        nearest = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        quiet_nan = ((bits >> 16) | np.uint32(0x40)).astype(np.uint16)
        return np.where((bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), quiet_nan, nearest)

    interpreter._convert_float = convert


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_rounds_bfloat16_to_nearest()


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

import fusedlm  # noqa: E402
from fusedlm.backends import cuda as cuda_backend  # noqa: E402


@pytest.fixture(params=fusedlm._C.supported_cpu_capabilities())
def cpu_isa(request):
    """Runs a test once per instruction set the processor supports."""
    before = fusedlm._C.cpu_capability()
    fusedlm._C.set_cpu_capability(request.param)
    yield request.param
    fusedlm._C.set_cpu_capability(before)


@pytest.fixture
def cuda_paths():
    """set(name, enabled): lets a cuda kernel path run, or not (fusedlm.backends.cuda.set_path),
    for the rest of the test; each path set is given back its previous value afterwards."""
    before = {}

    def set_path(name, enabled):
        if name not in before:
            before[name] = cuda_backend.paths()[name]
        cuda_backend.set_path(name, enabled)

    yield set_path
    for name, enabled in before.items():
        cuda_backend.set_path(name, enabled)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test draws new random inputs; pytest shows the printed seed when a test fails,
    and FUSEDLM_SEED=<seed> replays it."""
    seed = int(os.environ.get("FUSEDLM_SEED") or int.from_bytes(os.urandom(4), "little"))
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
