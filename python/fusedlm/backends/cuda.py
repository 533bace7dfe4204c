"""The cuda backend: fusedlm's hand-written CUDA kernels (kernels/cuda/), compiled into fusedlm._C."""
import torch

from .._extension import _C, _build_info
from . import Backend, register


def _unavailable():
    if not _C.with_cuda:
        return "fusedlm was built without CUDA (rebuild with FUSEDLM_CUDA=1 and a CUDA PyTorch)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def arches() -> str:
    """The CUDA architectures the extension was compiled for (TORCH_CUDA_ARCH_LIST)."""
    return _build_info.cuda_arches


BACKEND = register(Backend("cuda", lambda: ("cuda",), _unavailable, {}))
