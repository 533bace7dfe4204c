"""The cuda backend: fusedlm's hand-written CUDA kernels (kernels/cuda/), compiled into fusedlm._C.

It has add_layer_norm, bias_gelu, cross_entropy and masked_lm_loss, for float32, bfloat16
and float16; gelu_ffn (a tensor-core matrix product with the bias, GELU and dropout in its
epilogue) and attention and attention_varlen (FlashAttention-2 on the tensor cores) take
what their op files declare (fusedlm/ops/gelu.py, attention.py); other calls fall through
to triton. The attention backward is deterministic: no atomics, each gradient element is
written once, so equal inputs give equal gradients bit for bit.

A FUSEDLM_CUDA=emulate build compiles the same kernels as C++ against a CPU emulator
of CUDA, which acts as the GPU FUSEDLM_EMULATE_ARCH names (sm_80, the default, or
sm_90a) and runs one CPU thread per CUDA thread. There the backend needs no GPU and
runs on CPU tensors (not on CUDA ones: that build has no CUDA), slowly, to test the
kernels; it runs only when asked for by name, never by automatic choice.

Some kernels have two paths (the attention forward's resident and streamed K/V, the
Hopper wgmma products): :func:`set_path` turns one off, to compare it with the path it
replaces at the same shapes (FUSEDLM_ATTENTION_RESIDENT=0, FUSEDLM_ATTENTION_WGMMA=0 and
FUSEDLM_FFN_WGMMA=0 do at start).
"""
from typing import Optional

import torch

from .._extension import _C, _build_info
from . import GPU_FLOATS, Backend, Supports, register

# Whether the kernels run on the CPU emulator of CUDA (a FUSEDLM_CUDA=emulate build). An
# extension compiled before it had the `cuda_emulated` attribute is not.
EMULATED = bool(getattr(_C, "cuda_emulated", False))


def emulated() -> bool:
    """Whether the kernels run on the CPU emulator of CUDA (a FUSEDLM_CUDA=emulate build)."""
    return EMULATED


def emulated_arch() -> Optional[str]:
    """The GPU the emulator acts as ("sm_80" or "sm_90a", from FUSEDLM_EMULATE_ARCH), or
    None outside an emulated build."""
    return _C.cuda.emulated_arch() if EMULATED else None


def _unavailable():
    if not _C.with_cuda:
        return "fusedlm was built without CUDA (rebuild with FUSEDLM_CUDA=1 and a CUDA PyTorch)"
    if not EMULATED and not torch.cuda.is_available():
        return "no CUDA device"
    return None


def arches() -> str:
    """The CUDA architectures the extension was compiled for (TORCH_CUDA_ARCH_LIST)."""
    return _build_info.cuda_arches


def paths() -> dict:
    """{kernel path: whether it may run}: "attention_resident", "attention_wgmma", "ffn_wgmma"."""
    return dict(_C.cuda.paths())


def set_path(name: str, enabled: bool) -> None:
    """Lets kernel path ``name`` (see :func:`paths`) run, or not, from the next launch on."""
    if name not in paths():
        raise ValueError(f"name must be one of {sorted(paths())}, got {name!r}")
    _C.cuda.set_path(name, bool(enabled))


def keep_mask(seed, shape, p: float, device=None) -> torch.Tensor:
    """The dropout keep mask (bool, True = keep) the CUDA kernels draw for stream ``seed``,
    element order row-major over ``shape``, on CUDA device ``device`` (default: the
    current one). In an emulated build it is drawn by the emulator, on the CPU (the
    default there, and the only device it takes)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be a float in [0, 1), got {p!r}")
    if EMULATED:
        device = torch.device("cpu" if device is None else device)
        if device.type != "cpu":
            raise ValueError(f"the emulated cuda backend draws its masks on the CPU, not {device}")
        return _C.cuda.dropout_mask(seed, 0, list(shape), p, 0)
    device = torch.device("cuda" if device is None else device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _C.cuda.dropout_mask(seed, 0, list(shape), p, index)


def _find(op):
    """The kernels of an op are fusedlm._C.cuda.<op>_forward and <op>_backward."""
    forward = getattr(_C.cuda, f"{op.name}_forward", None) if _C.with_cuda else None
    return None if forward is None else (forward, getattr(_C.cuda, f"{op.name}_backward", None))


BACKEND = register(Backend(
    "cuda", ("cpu",) if EMULATED else ("cuda",), _unavailable(), _find, Supports(dtypes=GPU_FLOATS),
    emulated=lambda: f"emulated on the CPU as {emulated_arch()}" if EMULATED else None))
