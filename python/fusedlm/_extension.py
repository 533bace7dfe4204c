"""Loads the compiled extension fusedlm._C and checks it matches this torch."""
import torch

_REBUILD = "Rebuild it against this torch: `pip install --no-build-isolation --force-reinstall --no-deps fusedlm` (or `pip install --no-build-isolation -e .` in a checkout)."

try:
    from . import _build_info
    from . import _C
except ImportError as e:
    raise ImportError(f"fusedlm's compiled extension could not be loaded ({e}). {_REBUILD}") from e

if _build_info.torch_version != torch.__version__:
    raise ImportError(
        f"fusedlm was compiled against torch {_build_info.torch_version}, but torch "
        f"{torch.__version__} is installed. {_REBUILD}"
    )

__all__ = ["_C", "_build_info"]
