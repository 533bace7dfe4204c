"""The fuzzer's own measurements (tests/fuzz.py): the float64 truth it compares a kernel
with must be exact for what the kernel received, and its jittered runs of plain PyTorch
must measure the same gradients as the unmoved one."""
import pytest
import torch

import fuzz


def _doubling_case(dtype):
    """y = 2 x: its gradient is twice the upstream gradient, exactly in every dtype, so
    it shows the upstream gradient each run received."""
    d = fuzz.Draw(seed=torch.randint(2**31, ()).item())
    d.tensor("x", (4, 33), dtype, layouts=("contiguous",))
    case = fuzz.Case("doubling", f"doubling {dtype}", lambda t: ((t["x"],), {}),
                     lambda t: (2 * t["x"],), floors=(1.0,), dtype=dtype)
    return case, d


def _grad(case, d, dtype, jitter=None):
    upstream_seed = 12345
    _outputs, grads = fuzz._run(case, d, dtype, case.reference, upstream_seed, jitter)
    return grads["x"].double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_truth_gets_the_upstream_gradient_the_op_gets(dtype):
    # A float64 upstream gradient that the op under test receives rounded to its dtype
    # made a float16 lstm_cell's dc_prev "wrong" by 2%: dc nearly cancelled dh o tanh'(c).
    case, d = _doubling_case(dtype)
    assert torch.equal(_grad(case, d, torch.float64), _grad(case, d, None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_jittered_runs_undo_their_scaling_of_the_upstream_gradient(dtype):
    case, d = _doubling_case(dtype)
    exact = _grad(case, d, None)
    jitter = torch.Generator().manual_seed(7)
    for _ in range(4):
        moved = _grad(case, d, None, jitter)
        # Off by the one rounding of the scaled upstream gradient (and of 2 x in the dtype),
        # not by the scale factor (up to 19%).
        error = ((moved - exact).abs() / exact.abs().clamp(min=1e-3)).max().item()
        assert error <= 2 * torch.finfo(dtype).eps, error
