"""Backends and dispatch.

Every op has five backends: ``reference`` (plain PyTorch in float32 or wider, the ground
truth), ``torch`` (PyTorch's own composition in the inputs' dtype, what users run without
fusedlm), ``cpu`` (the C++ kernels), ``triton`` and ``cuda``. Three modules say how a call
reaches one, each with one role:

- :mod:`.registry`: the backends, the declared ops and what each backend's kernels take;
- :mod:`.forcing`: the backend :func:`use_backend`, :func:`set_backend` or
  ``FUSEDLM_BACKEND`` forces calls to;
- :mod:`.dispatch`: the choice of backend for a call (:func:`explain` tells it, and why),
  the planners' memo, and the policy on index tensors' values.

Each backend's module registers it: :mod:`.cpu`, :mod:`.cuda`, :mod:`.triton`,
:mod:`.pytorch` and :mod:`.reference`. Two backends can also run on CPU tensors, slowly, to
test their kernels without a GPU: ``triton`` under ``TRITON_INTERPRET=1`` (Triton's
interpreter) and ``cuda`` in a ``FUSEDLM_CUDA=emulate`` build (the CUDA kernels compiled
against a CPU emulator of CUDA). Either runs only when named, never by automatic choice.

Environment switches are read once, when fusedlm is imported (fusedlm.switches).
"""
from .dispatch import (Choice, check_index_data, choose, explain, forget_choices,  # noqa: F401
                       install_checks, install_tuner, planner, unobserved)
from .forcing import get_backend, set_backend, use_backend  # noqa: F401
from .registry import (_OPS, _REGISTRY, BACKEND_NAMES, FLOATS, GPU_FLOATS, HALVES,  # noqa: F401
                       KERNEL_BACKENDS, Backend, Emulated, Kernel, OpInfo, Supports, backends,
                       declare, declared, filled, kernel, register)

from . import cpu, cuda, pytorch, reference, triton  # noqa: E402,F401  (each registers itself)
