"""fusedlm: fused attention, add+LayerNorm, GELU feed-forward and cross-entropy
kernels (CUDA, Triton and C++ CPU) for the transformer language models of the
pretraining era.

    import fusedlm
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask)
    fusedlm.explain("attention", q, k, v)   # which backend runs this call, and why
"""
from ._extension import _C  # noqa: F401  (fails early, with a rebuild hint, on a bad build)
from ._version import __version__
from . import nn, ops
from . import verify  # noqa: F401  (above the ops it runs; it installs the device checks)
from .verify import tuning  # noqa: F401  (the same for the timing of automatic choices)
from .backends import backends, explain, get_backend, set_backend, use_backend
from .backends import registry as _registry
from .patching import patch, patch_report
from .patching import transformers_hook

transformers_hook.install()  # attn_implementation="fusedlm", once transformers is imported
_registry.find_kernels()  # now that every op is declared: never inside a torch.compile trace


def __getattr__(name):
    # fusedlm.models needs transformers; ops, nn and patch do not, so it loads on first use.
    if name == "models":
        import importlib

        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["models", "nn", "ops", "backends", "explain", "get_backend", "patch", "patch_report", "set_backend",
           "use_backend", "__version__"]
