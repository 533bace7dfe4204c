"""``import fusedlm`` makes ``attn_implementation="fusedlm"`` available to transformers
without importing transformers itself.

transformers checks an implementation's name against its AttentionInterface, which lives
in ``transformers.modeling_utils``: the name is registered (hf_attention.register) as soon
as that module has run. If it already has, that is now; otherwise a finder placed first on
``sys.meta_path`` waits for its import, lets the usual finders locate it, and registers
once its code has run. Importing fusedlm thus costs nothing where transformers is never
used.
"""
import importlib.abc
import importlib.util
import sys
import warnings

_TARGET = "transformers.modeling_utils"


def install() -> None:
    if sys.modules.get(_TARGET) is not None:
        _register()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _register() -> None:
    """Registers fusedlm's implementation; a failure warns instead of breaking transformers."""
    try:
        from . import hf_attention

        why = hf_attention.register()
    except Exception as error:  # noqa: BLE001  (any failure: transformers must still import)
        why = f"{type(error).__name__}: {error}"
    if why is not None:
        warnings.warn(f"fusedlm: attn_implementation='fusedlm' is unavailable: {why}",
                      stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of transformers.modeling_utils so that
    fusedlm registers when that module has run, then leaves sys.meta_path."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec
