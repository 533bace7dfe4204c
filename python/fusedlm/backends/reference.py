"""The reference backend: plain PyTorch (fusedlm.ops.reference), for every op, on any device."""
from ..ops import reference
from . import Backend, Kernel, register


class _AnyDevice(tuple):
    def __contains__(self, device_type) -> bool:
        return True


# Public ops call these directly (torch's autograd differentiates them), so no backward.
BACKEND = register(
    Backend(
        "reference",
        lambda: _AnyDevice(("any",)),
        lambda: None,
        {op: Kernel(getattr(reference, op)) for op in reference.__all__},
    )
)
