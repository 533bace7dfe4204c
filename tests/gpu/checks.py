"""What the GPU tests share: the skip, poisoned memory, and norm-wise relative error.

They run the kernels at real shapes (BERT-base: 32 x 128 tokens, hidden 768, FFN 3072,
vocab 30522; GPT-2 small: 8 x 1024 tokens, vocab 50257) and compare them with the
reference evaluated in float32 on the same inputs.
"""
import pytest
import torch

from fusedlm.backends import _REGISTRY
from fusedlm.backends import cuda as cuda_backend
from fusedlm.backends import triton as triton_backend
from helpers import skip_if_refused  # noqa: F401  (tests/helpers.py's, for the GPU tests too)

needs_cuda = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_backends(op):
    """pytest params: the GPU backends that implement `op` (the cuda one skipped when this
    build has no CUDA kernels)."""
    params = [pytest.param("triton", id="triton")]
    reason = _REGISTRY["cuda"].unavailable or (None if op in _REGISTRY["cuda"].kernels
                                                  else f"no {op} kernel")
    params.append(pytest.param("cuda", id="cuda",
                               marks=[pytest.mark.skip(reason=f"cuda: {reason}")] if reason else []))
    return params


def keep_mask(backend, seed, shape, p):
    """The dropout keep mask `backend` draws for stream `seed`, on the GPU."""
    module = {"triton": triton_backend, "cuda": cuda_backend}[backend]
    return module.keep_mask(seed, shape, p, "cuda")


# Largest norm-wise relative error against the float32 reference, by the kernel's dtype.
MAX_RELATIVE_ERROR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def poison_memory():
    """Fills memory the caching allocator will hand out next with NaN, so an output element a
    kernel forgets to write shows up instead of reading as a plausible stale value."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    blocks = [torch.full((min(free // 2, 8 << 30) // 4,), float("nan"), device="cuda")]
    # Small allocations come from their own pool of 2 MiB segments.
    blocks += [torch.full((1 << 18,), float("nan"), device="cuda") for _ in range(64)]
    torch.cuda.synchronize()
    del blocks


def assert_relative_error(actual, expected, dtype, name, bound=None):
    """||actual - expected|| / ||expected|| within `bound`, by default the dtype's (NaN fails)."""
    actual, expected = actual.double(), expected.double()
    error = ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    bound = MAX_RELATIVE_ERROR[dtype] if bound is None else bound
    assert error <= bound, f"{name}: relative error {error:.3g} > {bound:g} ({dtype})"


def fresh(shape, dtype, scale=1.0):
    """New random CUDA inputs each run (never zeros), requiring grad."""
    t = torch.randn(shape, device="cuda", dtype=torch.float32) * scale
    return t.to(dtype).requires_grad_()


def float32_copies(*tensors):
    return [None if t is None else t.detach().float().requires_grad_() for t in tensors]


def grads(outputs, inputs, upstream):
    present = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(outputs, present, upstream))
    return [None if t is None else next(got) for t in inputs]
