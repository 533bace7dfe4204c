"""Backend registry and dispatch: automatic choice, overrides, and clear errors."""
import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlm
from fusedlm.backends import BACKEND_NAMES, FLOATS, _OPS, _REGISTRY, Emulated, Supports, choose
from fusedlm.backends import cuda as cuda_backend
from cli_helpers import run_cli

# Tests of the cuda backend on CUDA tensors need it to run on a GPU: not emulated.
needs_native_cuda = pytest.mark.skipif(fusedlm.backends()["cuda"] is not True,
                                       reason="the cuda backend does not run on a GPU here")


def needs_emulated_cuda(test):
    """A test of a FUSEDLM_CUDA=emulate build, where the cuda backend runs on CPU tensors on
    the emulator: marked cuda, so that `make test-emulated` (pytest -m cuda) runs it."""
    skip = pytest.mark.skipif(not cuda_backend.emulated(), reason="not a FUSEDLM_CUDA=emulate build")
    return pytest.mark.cuda(skip(test))


def test_backends_reports_every_backend():
    status = fusedlm.backends()
    assert set(status) == set(BACKEND_NAMES)
    assert status["reference"] is True and status["cpu"] is True
    for name in ("triton", "cuda"):
        assert status[name] is True or isinstance(status[name], str) and status[name]


def test_cpu_tensors_go_to_the_cpu_backend():
    x = torch.randn(4, 8)
    assert fusedlm.explain("bias_gelu", x, None).startswith("bias_gelu -> cpu:")


def test_set_backend_and_use_backend_override_the_choice():
    x = torch.randn(4, 8)
    try:
        fusedlm.set_backend("reference")
        assert "fusedlm.set_backend()" in fusedlm.explain("bias_gelu", x, None)
        assert fusedlm.get_backend() == "reference"
        with fusedlm.use_backend("cpu"):  # wins over set_backend; blocks nest
            assert fusedlm.get_backend() == "cpu"
            with fusedlm.use_backend("reference"):
                assert "fusedlm.use_backend()" in fusedlm.explain("bias_gelu", x, None)
                assert fusedlm.get_backend() == "reference"
            with fusedlm.use_backend(None):  # leaves the choice as it is
                assert fusedlm.get_backend() == "cpu"
            # The call's own backend= wins over all.
            assert "backend= argument" in fusedlm.explain("bias_gelu", x, None, backend="reference")
        assert fusedlm.get_backend() == "reference"
    finally:
        fusedlm.set_backend(None)
    assert fusedlm.get_backend() is None
    with pytest.raises(ValueError, match="backend"):
        fusedlm.use_backend("fast")


def test_use_backend_traces_under_compile():
    x = torch.randn(4, 8)

    def run(x):
        with fusedlm.use_backend("reference"):
            return fusedlm.ops.bias_gelu(x, None)

    torch.testing.assert_close(torch.compile(run, fullgraph=True, backend="aot_eager")(x),
                               torch.nn.functional.gelu(x))


# The backends found their kernels at an op's first call, handing the Python ones to the
# compiled routing through fusedlm._C, which dynamo cannot trace: where that first call was
# inside torch.compile(fullgraph=True), compiling failed. import fusedlm finds them now.
def test_first_call_of_a_process_may_be_compiled():
    code = """
import torch, fusedlm
q, k, v = (torch.randn(2, 4, 16, 32, requires_grad=True) for _ in range(3))
x = torch.randn(2, 16, 32, requires_grad=True)
w, b = torch.ones(32, requires_grad=True), torch.zeros(32, requires_grad=True)

def loss(q, k, v, x, w, b):
    out = fusedlm.ops.attention(q, k, v, causal=True)
    normed, _ = fusedlm.ops.add_layer_norm(x, x.flip(0), w, b)
    return out.sum() + normed.square().sum() + fusedlm.ops.bias_gelu(x, b).sum()

compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, x, w, b)
compiled.backward()
grads = [t.grad for t in (q, k, v, x, w, b)]
for t in (q, k, v, x, w, b):
    t.grad = None
expected = loss(q, k, v, x, w, b)
expected.backward()
torch.testing.assert_close(compiled, expected)
for got, t in zip(grads, (q, k, v, x, w, b)):
    torch.testing.assert_close(got, t.grad)
print("matched")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "matched" in out.stdout, out.stderr[-3000:]


def test_environment_backend_is_read_at_import():
    code = ("import torch, fusedlm; print(fusedlm.explain('bias_gelu', torch.randn(2, 3), None))")
    env = dict(os.environ, FUSEDLM_BACKEND="reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert "reference: asked for by FUSEDLM_BACKEND" in out.stdout
    env["FUSEDLM_BACKEND"] = "fast"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "FUSEDLM_BACKEND must be one of" in out.stderr


def test_named_backend_that_cannot_run_raises():
    x = torch.randn(4, 8)
    # float64, which the cuda kernels refuse even where they run on CPU tensors (emulated).
    with pytest.raises(RuntimeError, match="cuda"):
        fusedlm.ops.bias_gelu(x.double(), None, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        fusedlm.ops.bias_gelu(x, None, backend="fast")
    with pytest.raises(ValueError, match="backend"):
        fusedlm.set_backend("fast")


def test_supports_names_the_first_feature_it_refuses():
    supports = Supports(dtypes=(torch.float16,), head_dims=(64, 128), same_head_dim_v=True,
                        bias=False, multiple_of=8)
    takes = dict(dtype=torch.float16, head_dim=64, head_dim_v=64, bias=False, sizes=(16, 24))
    assert supports.refuses("k", **takes) is None
    for change, reason in [({"dtype": torch.float32}, "the k takes float16, not float32"),
                           ({"head_dim": 80, "head_dim_v": 80}, "head_dim of 64 or 128, not 80"),
                           ({"head_dim_v": 128}, "v with q's head_dim (64), not 128"),
                           ({"bias": True}, "takes no attn_bias"),
                           ({"sizes": (16, 20)}, "multiples of 8, not (16, 20)")]:
        assert reason in supports.refuses("k", **{**takes, **change})
    assert "up to 256, not 512" in Supports(max_head_dim=256).refuses("k", head_dim=512)


def test_supports_names_the_slower_entry_a_call_matches():
    supports = Supports(slower=({"dtype": torch.float16}, {"dtype": torch.bfloat16, "causal": False}))
    assert supports.slower_for(dtype=torch.float16, causal=True) == "dtype=float16"
    assert supports.slower_for(dtype=torch.bfloat16, causal=False) == "dtype=bfloat16, causal=False"
    assert supports.slower_for(dtype=torch.bfloat16, causal=True) is None
    assert supports.slower_for(dtype=torch.float32) is None


def test_automatic_choice_passes_over_a_kernel_declared_slower():
    # Every declaration of a CPU kernel slower than plain PyTorch, as a call would meet it:
    # automatic choice goes on to the next backend and says why; named, the kernel runs.
    cpu = torch.device("cpu")
    for op, info in _OPS.items():
        for entry in info.supports.get("cpu", Supports()).slower:
            chosen = choose(op, cpu, **entry)
            assert chosen.backend == "torch", op
            assert "cpu: measured slower than plain PyTorch" in chosen.why, op
            assert choose(op, cpu, "cpu", **entry).backend == "cpu", op


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_a_named_backend_refuses_exactly_what_it_declares(name):
    backend = _REGISTRY[name]
    if backend.unavailable:
        pytest.skip(backend.unavailable)
    device = torch.device("cpu" if "any" in backend.devices else backend.devices[0])
    for op, kernel in backend.kernels.items():
        for dtype in FLOATS:
            reason = kernel.supports.refuses(f"{name} {op}", dtype=dtype)
            if reason:
                with pytest.raises(RuntimeError, match=re.escape(reason)):
                    choose(op, device, name, dtype=dtype)
            else:
                assert choose(op, device, name, dtype=dtype).backend == name


@needs_native_cuda
def test_cuda_attention_refusal_falls_through_with_its_reason():
    q = torch.randn(1, 2, 5, 40, dtype=torch.bfloat16, device="cuda")
    why = fusedlm.explain("attention", q, q, q)
    assert "skipped cuda: the cuda attention takes a head_dim of 64 or 128, not 40" in why
    assert not why.startswith("attention -> cuda")


@needs_native_cuda
def test_cuda_gelu_ffn_refusal_falls_through_to_triton():
    x = torch.randn(4, 48, device="cuda")
    w1, w2 = torch.randn(136, 48, device="cuda"), torch.randn(40, 136, device="cuda")
    why = fusedlm.explain("gelu_ffn", x, w1, None, w2, None)
    assert why.startswith("gelu_ffn -> triton") and "bfloat16 or float16, not float32" in why
    assert fusedlm.explain("gelu_ffn", x.bfloat16(), w1.bfloat16(), None, w2.bfloat16(),
                           None).startswith("gelu_ffn -> cuda")


@contextlib.contextmanager
def _changed(backend, **fields):
    """Backend ``backend`` with these fields, through Backend.change, which forgets the
    choices made with the old ones; restored after."""
    old = _REGISTRY[backend].change(**fields)
    try:
        yield
    finally:
        _REGISTRY[backend].change(**old)


@_changed("cpu", emulated=lambda: "emulated on the CPU as a test")
def test_an_emulated_backend_runs_only_when_named():
    # The cpu backend posing as an emulation: reported as one, never chosen automatically,
    # and still run when named.
    status = fusedlm.backends()["cpu"]
    assert isinstance(status, Emulated) and status == "emulated on the CPU as a test"
    x = torch.randn(4, 8)
    why = fusedlm.explain("bias_gelu", x, None)
    assert why.startswith("bias_gelu -> torch")
    assert "skipped cpu: emulated on the CPU as a test, so only when asked for by name" in why
    assert fusedlm.explain("bias_gelu", x, None, backend="cpu").startswith("bias_gelu -> cpu")


class BackendsCalled(TorchDispatchMode):
    """The backend each fusedlm op called below autograd ran on (its last argument), or
    "torch" for a call of torch's own ops alone (the torch backend's composition)."""

    def __init__(self):
        super().__init__()
        self.backends = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedlm":
            self.backends.append(args[-1])
        return func(*args, **(kwargs or {}))


def backend_of(call) -> str:
    with BackendsCalled() as called:
        call()
    return called.backends[0] if called.backends else "torch"


def test_a_change_to_a_backend_changes_the_choices_already_made():
    # The planners memoise their answers per call: a backend switched off after a call (and
    # back on) must change the next one's choice, automatic and asked for by name.
    x = torch.randn(4, 8)
    assert backend_of(lambda: fusedlm.ops.bias_gelu(x)) == "cpu"
    assert backend_of(lambda: fusedlm.ops.bias_gelu(x, backend="cpu")) == "cpu"
    with _changed("cpu", unavailable="switched off"):
        assert backend_of(lambda: fusedlm.ops.bias_gelu(x)) == "torch"
        assert fusedlm.explain("bias_gelu", x, None).startswith("bias_gelu -> torch")
        with pytest.raises(RuntimeError, match="cannot run on backend 'cpu'.*switched off"):
            fusedlm.ops.bias_gelu(x, backend="cpu")
    assert backend_of(lambda: fusedlm.ops.bias_gelu(x)) == "cpu"
    assert backend_of(lambda: fusedlm.ops.bias_gelu(x, backend="cpu")) == "cpu"
    with fusedlm.use_backend("reference"):
        assert backend_of(lambda: fusedlm.ops.bias_gelu(x)) == "reference"
    assert backend_of(lambda: fusedlm.ops.bias_gelu(x)) == "cpu"


def test_a_memoised_call_is_still_checked():
    # A call whose arguments differ from a memoised one only in what its checks read (a
    # shape, bool against int, the grad mode, an index tensor's values) is checked afresh.
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        fusedlm.ops.add_layer_norm(x, r, None, None, 1)
        with pytest.raises(ValueError, match="residual must have shape"):
            fusedlm.ops.add_layer_norm(x, r[:, :4], None, None, 1)
        with pytest.raises(ValueError, match="eps must be a finite float"):
            fusedlm.ops.add_layer_norm(x, r, None, None, True)
    student, teacher = torch.randn(3, 5), torch.randn(3, 5, requires_grad=True)
    for _ in range(2):
        with torch.no_grad():
            fusedlm.ops.distillation_loss(student, teacher)
        with pytest.raises(ValueError, match="teacher_logits"):
            fusedlm.ops.distillation_loss(student, teacher)
    logits, labels = torch.randn(3, 5), torch.tensor([0, 1, 2])
    for backend in ("cpu", "reference"):
        fusedlm.ops.cross_entropy(logits, labels, backend=backend)
        with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 5\)"):
            fusedlm.ops.cross_entropy(logits, torch.tensor([0, 7, 2]), backend=backend)


def test_call_key_holds_what_a_planner_reads():
    from fusedlm._extension import _C
    x = torch.randn(4, 8)
    free = (None, None)  # the forcing: no backend forced

    def key_of(args, kwargs, forcing=free):
        return _C.call_key(args, kwargs, forcing)

    key = key_of((x, None, 1.0), {"backend": "cpu"})
    assert key == key_of((torch.randn(4, 8), None, 1.0), {"backend": "cpu"})
    for other in ((x.t().contiguous().t(), None, 1.0), (x.double(), None, 1.0), (x, None, 1),
                  (x, None, True), (x[:, :4], None, 1.0), (x.clone().requires_grad_(), None, 1.0)):
        assert key_of(other, {"backend": "cpu"}) != key
    assert key_of((x, None, 1.0), {"backend": None}) != key
    assert key_of((x, None, 1.0), {"backend": "cpu"}, ("cpu", "fusedlm.set_backend()")) != key
    with torch.no_grad():
        assert key_of((x, None, 1.0), {"backend": "cpu"}) != key
    assert key_of((torch.nn.Parameter(x),), {}) != key_of((x,), {})
    # What a key cannot hold exactly: the call is planned afresh.
    for unkeyed in (x.as_subclass(_Subclass), object(), 2**80,
                    torch.zeros(3).to_sparse()):
        assert key_of((unkeyed,), {}) is None
    with pytest.raises(TypeError, match="call_key takes"):
        _C.call_key((x,), {})


class _Subclass(torch.Tensor):
    pass


@pytest.mark.cuda
@needs_emulated_cuda
def test_emulated_cuda_is_reported_as_emulated(capsys):
    arch = os.environ.get("FUSEDLM_EMULATE_ARCH", "sm_80")
    assert cuda_backend.emulated_arch() == arch
    status = fusedlm.backends()["cuda"]
    assert isinstance(status, Emulated) and status == f"emulated on the CPU as {arch}"
    assert _REGISTRY["cuda"].devices == ("cpu",)
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert f"available, emulated on the CPU as {arch}" in out
    assert f"{arch}, emulated" in out


@pytest.mark.cuda
@needs_emulated_cuda
def test_emulated_cuda_is_never_chosen_automatically(monkeypatch):
    # Training calls (bias_gelu's bfloat16 inference is left to the reference on the CPU).
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    w1, w2 = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    # Calls the cuda kernels take, on CPU tensors: the cpu backend's.
    for why in (fusedlm.explain("bias_gelu", x, None), fusedlm.explain("attention", q, q, q),
                fusedlm.explain("gelu_ffn", x, w1, None, w2, None),
                fusedlm.explain("add_layer_norm", x, None, None, None)):
        assert why.split(" -> ")[1].startswith("cpu:"), why
    # Nor on CUDA tensors, which the emulated backend does not take.
    choice = choose("bias_gelu", torch.device("cuda"), dtype=torch.bfloat16)
    assert choice.backend != "cuda" and "skipped cuda: runs on cpu tensors (emulated" in choice.why
    # With the cpu backend out of the running, still not: PyTorch's own composition.
    with _changed("cpu", unavailable="switched off"):
        assert fusedlm.explain("bias_gelu", x, None).startswith("bias_gelu -> torch")


@pytest.mark.cuda
@needs_emulated_cuda
def test_emulated_cuda_runs_when_named():
    x, bias = torch.randn(5, 40), torch.randn(40)
    assert fusedlm.explain("bias_gelu", x, bias, backend="cuda").startswith("bias_gelu -> cuda")
    torch.testing.assert_close(fusedlm.ops.bias_gelu(x, bias, backend="cuda"),
                               torch.nn.functional.gelu(x + bias))
    # The dropout stream's mask, on the CPU by default, the same for the same seed.
    seed = torch.tensor(1234, dtype=torch.int64)
    keep = cuda_backend.keep_mask(seed, (6, 70), 0.3)
    assert keep.device.type == "cpu" and keep.dtype == torch.bool and keep.shape == (6, 70)
    assert torch.equal(keep, cuda_backend.keep_mask(seed, (6, 70), 0.3, "cpu"))
    assert 0 < keep.sum() < keep.numel()
    with pytest.raises(ValueError, match="CPU"):
        cuda_backend.keep_mask(seed, (6, 70), 0.3, "cuda")


def test_reference_backend_runs_everywhere():
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(fusedlm.ops.bias_gelu(x, None, backend="reference"),
                               torch.nn.functional.gelu(x))


def test_explain_rejects_unknown_ops():
    with pytest.raises(ValueError, match="op"):
        fusedlm.explain("softmax", torch.randn(2))


def test_instruction_set_can_be_lowered_by_environment():
    code = "import fusedlm; print(fusedlm._C.cpu_capability())"
    env = dict(os.environ, FUSEDLM_CPU_CAPABILITY="baseline")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "baseline"


def test_mismatched_torch_build_asks_for_a_rebuild(tmp_path):
    # A copy of the package whose build record names another torch version must refuse to import.
    import shutil

    package = tmp_path / "fusedlm"
    shutil.copytree(os.path.dirname(fusedlm.__file__), package)
    (package / "_build_info.py").write_text("torch_version = '0.0.0'\ncuda_version = None\ncuda_arches = ''\n")
    code = "import fusedlm"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert "compiled against torch 0.0.0" in out.stderr and "Rebuild" in out.stderr


@pytest.mark.parametrize("capability, arch_list, runs", [
    ((8, 0), "8.0;9.0a", True), ((8, 6), "8.0;9.0a", True), ((8, 9), "8.0;9.0a", True),
    ((9, 0), "8.0;9.0a", True),
    ((7, 0), "8.0+PTX;9.0a", False), ((7, 5), "8.0+PTX;9.0a", False),  # PTX compiles forward only
    ((12, 1), "8.0+PTX;9.0a", True), ((7, 5), "7.5;8.0", True),
    ((10, 0), "8.0;9.0a", False), ((12, 0), "8.0;9.0a", False),  # no PTX: nothing for Blackwell
    ((10, 0), "8.0+PTX;9.0a", True), ((12, 0), "8.0+PTX;9.0a", True),
    ((8, 9), "9.0a", False), ((10, 0), "9.0a+PTX", False),  # arch-specific code: 9.0 alone
    ((10, 0), "80;90a-real", True), ((10, 0), "80-real;90a", False),  # CMake's spelling
])
def test_which_gpus_run_which_builds(capability, arch_list, runs):
    assert cuda_backend.runs_built_code(capability, arch_list) is runs


@pytest.mark.skipif(cuda_backend.emulated(), reason="an emulated build runs on no GPU")
@pytest.mark.parametrize("capability, arches, reason", [
    ((7, 5), "8.0+PTX;9.0a", "compute capability 7.5: the cuda kernels need 8.0 or newer"),
    ((10, 0), "8.0;9.0a", "compute capability 10.0: fusedlm was built for '8.0;9.0a', with no code"),
    ((12, 0), "8.0+PTX;9.0a", None),
])
def test_the_cuda_backend_refuses_a_gpu_it_has_no_code_for(monkeypatch, capability, arches, reason):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(cuda_backend, "arches", lambda: arches)
    cuda_backend._refusal.cache_clear()
    try:
        refused = cuda_backend.refuses_device(torch.device("cuda", 0))
    finally:
        cuda_backend._refusal.cache_clear()
    assert refused == reason if reason is None else refused.startswith(reason)


@_changed("cpu", refuses_device=lambda device: "compute capability 7.5: too old")
def test_a_device_a_backend_refuses_falls_through_with_the_reason():
    x = torch.randn(3, 8)
    why = fusedlm.explain("bias_gelu", x)
    assert why.startswith("bias_gelu -> torch") and "skipped cpu: compute capability 7.5" in why
    with pytest.raises(RuntimeError, match="cannot run on backend 'cpu'.*compute capability 7.5"):
        fusedlm.ops.bias_gelu(x, backend="cpu")


def test_the_cuda_kernels_refuse_grids_past_one_launchs_limits():
    # 65535 tiles of 128 rows is the most the cuda FFN's grid holds; attention's grid has
    # the heads and the sequences on its y and z dimensions.
    ffn = _OPS["gelu_ffn"].supports["cuda"]
    assert "the cuda gelu_ffn takes up to 8388480 rows, not 8388481" in ffn.refuses(
        "cuda gelu_ffn", dtype=torch.bfloat16, rows=8388481)
    assert ffn.refuses("cuda gelu_ffn", dtype=torch.bfloat16, sizes=(8, 8, 8), rows=8388480) is None
    attention = _OPS["attention_varlen"].supports["cuda"]
    assert "up to 65535 sequences, not 70000" in attention.refuses(
        "cuda attention_varlen", dtype=torch.bfloat16, head_dim=64, sequences=70000)
