"""fusedlm's ops. Each is differentiable, registered with torch.library (so
torch.compile traces it without graph breaks), and runs on the backend chosen
by fusedlm.backends; ``backend=`` names one explicitly.

Conventions: key_padding_mask is bool [batch, seq_k] with True = padding; with
seq_q != seq_k, causal aligns to the bottom right; rows with every key masked
are zeros; dropout draws its seed from torch's generator.
"""
import importlib
import pkgutil

from . import reference

__all__ = ["reference"]

# Every op file (fusedlm/ops/<op>.py) declares its ops and lists its public functions in
# its __all__; importing it registers them.
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "reference":
        _ops = importlib.import_module(f".{_module.name}", __name__)
        globals().update({name: getattr(_ops, name) for name in _ops.__all__})
        __all__ += _ops.__all__
del _module, _ops
