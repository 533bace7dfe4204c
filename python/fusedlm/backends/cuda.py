"""The cuda backend: fusedlm's hand-written CUDA kernels (kernels/cuda/), compiled into fusedlm._C.

An op has cuda kernels where kernels/cuda/ defines them (<op>_forward and <op>_backward,
in kernels/cuda/<op>.cu), for float32, bfloat16 and float16 unless its op file declares
less (gelu_ffn and attention do: fusedlm/ops/gelu.py, attention.py); other calls fall
through to triton. The attention backward is deterministic: no atomics, each gradient
element is written once, so equal inputs give equal gradients bit for bit.

A FUSEDLM_CUDA=emulate build compiles the same kernels as C++ against a CPU emulator
of CUDA, which acts as the GPU FUSEDLM_EMULATE_ARCH names (sm_80, the default, or
sm_90a) and runs one CPU thread per CUDA thread. There the backend needs no GPU and
runs on CPU tensors (not on CUDA ones: that build has no CUDA), slowly, to test the
kernels; it runs only when asked for by name, never by automatic choice.

Some kernels have two paths (the attention's resident and streamed walks, its backward in
one kernel up to 512 keys or in three, the FFN's cuBLAS products and its own fused ones,
the Hopper wgmma products): :func:`set_path` turns one off, to compare it with the path it
replaces at the same shapes (FUSEDLM_ATTENTION_RESIDENT=0, FUSEDLM_ATTENTION_WGMMA=0,
FUSEDLM_ATTENTION_FUSED_BACKWARD=0, FUSEDLM_FFN_CUBLAS=0 and FUSEDLM_FFN_WGMMA=0 do at
start).
"""
import contextlib
import dataclasses
import functools
import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .._extension import _C, _build_info
from ..dtypes import GPU_FLOATS
from .registry import Backend, Supports, register

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


@dataclasses.dataclass(frozen=True)
class LaunchCount:
    """What one emulated launch moved and computed: per tensor the op exposed to it (keyed
    by its storage's address: ``t.untyped_storage().data_ptr()``), the bytes its kernel
    loaded and stored (every access as issued, before any cache: a re-read counts again),
    and the multiply-adds its tensor-core instructions issued."""

    kernel: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    shared_bytes: int
    tensor_core_macs: int
    read: Dict[int, int]
    written: Dict[int, int]
    sizes: Dict[int, int]  # each storage's bytes

    def traffic(self, t: torch.Tensor) -> Tuple[int, int]:
        """(bytes read, bytes written) of ``t``'s storage in this launch."""
        storage = t.untyped_storage().data_ptr()
        return self.read.get(storage, 0), self.written.get(storage, 0)


@contextlib.contextmanager
def count_launches() -> Iterator[List[LaunchCount]]:
    """Counts the launches of the emulated kernels run inside the block; the list it gives
    is filled when the block ends. Needs an emulated build (:func:`emulated`)."""
    if not EMULATED:
        raise RuntimeError("count_launches needs the emulated build (FUSEDLM_CUDA=emulate)")
    counted: List[LaunchCount] = []
    _C.cuda.count_launches(True)
    try:
        yield counted
    finally:
        _C.cuda.count_launches(False)
        for launch in _C.cuda.counted_launches():
            tensors = launch["tensors"]
            counted.append(LaunchCount(
                kernel=launch["kernel"], grid=launch["grid"], block=launch["block"],
                shared_bytes=launch["shared_bytes"], tensor_core_macs=launch["tensor_core_macs"],
                read={base: read for base, _, read, _ in tensors},
                written={base: written for base, _, _, written in tensors},
                sizes={base: size for base, size, _, _ in tensors}))


def _unavailable():
    if not _C.with_cuda:
        return "fusedlm was built without CUDA (rebuild with FUSEDLM_CUDA=1 and a CUDA PyTorch)"
    if not EMULATED and not torch.cuda.is_available():
        return "no CUDA device"
    return None


def arches() -> str:
    """The CUDA architectures the extension was compiled for (TORCH_CUDA_ARCH_LIST)."""
    return _build_info.cuda_arches


# Oldest compute capability with what every kernel uses: bf16 mma.sync, ldmatrix, cp.async.
MIN_CAPABILITY = (8, 0)


def _targets(arch_list: str):
    """(major, minor, arch-specific, with PTX) of each entry of an architecture list, in
    TORCH_CUDA_ARCH_LIST's spelling ("8.0;9.0a", "8.0+PTX": PTX only where named) or
    CMake's ("80;90a-real": PTX unless -real)."""
    for entry in re.split(r"[;, ]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+)(\.?)(\d)([af]?)(\+PTX|-real|-virtual)?", entry)
        if match:
            cmake = not match[2]
            ptx = match[5] == "+PTX" if not cmake else match[5] != "-real"
            yield int(match[1]), int(match[3]), bool(match[4]), ptx


def runs_built_code(capability: tuple, arch_list: str) -> bool:
    """Whether a GPU of ``capability`` (major, minor) can run code compiled for
    ``arch_list``. Machine code for X.Y runs on X.Z for Z >= Y, an arch-specific target's
    (9.0a) on X.Y alone; PTX is compiled by the driver for any later GPU, except an
    arch-specific target's."""
    for major, minor, specific, ptx in _targets(arch_list):
        if specific:
            if capability == (major, minor):
                return True
        elif (capability[0] == major and capability[1] >= minor) or (ptx and capability >= (major, minor)):
            return True
    return False


def paths() -> dict:
    """{kernel path: whether it may run}: "attention_resident", "attention_wgmma",
    "attention_fused_backward", "ffn_cublas", "ffn_wgmma"."""
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


@functools.lru_cache(maxsize=None)
def _refusal(index: int) -> Optional[str]:
    capability = torch.cuda.get_device_capability(index)
    have = "compute capability {}.{}".format(*capability)
    if capability < MIN_CAPABILITY:
        return f"{have}: the cuda kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer"
    if not runs_built_code(capability, arches()):
        return (f"{have}: fusedlm was built for {arches()!r}, with no code this GPU runs "
                f"(rebuild with TORCH_CUDA_ARCH_LIST including {capability[0]}.{capability[1]})")
    return None


def refuses_device(device: torch.device) -> Optional[str]:
    """Why the cuda kernels cannot run on ``device`` (its compute capability is too old,
    or the build holds no code it runs), or None; asked of the driver once per device."""
    if EMULATED or device.type != "cuda":
        return None
    return _refusal(device.index if device.index is not None else torch.cuda.current_device())


def _find(op):
    """The kernels of an op are fusedlm._C.cuda.<op>_forward and <op>_backward."""
    forward = getattr(_C.cuda, f"{op.name}_forward", None) if _C.with_cuda else None
    return None if forward is None else (forward, getattr(_C.cuda, f"{op.name}_backward", None))


BACKEND = register(Backend(
    "cuda", ("cpu",) if EMULATED else ("cuda",), _unavailable(), _find, Supports(dtypes=GPU_FLOATS),
    emulated=lambda: f"emulated on the CPU as {emulated_arch()}" if EMULATED else None,
    refuses_device=refuses_device, compiled=True))
