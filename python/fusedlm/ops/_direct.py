"""When an op may call its backend's kernel directly instead of its registered torch op.

The registered op (torch.library.custom_op) is what autograd, torch.compile, fake
tensors and dispatch modes see, and its Python dispatch costs tens of microseconds a
call: nothing next to a training batch, but most of a decoding step's time at batch 1,
whose ops each touch a few rows. Where none of those can be watching (no gradient is
recorded, nothing is being compiled or traced, no dispatch mode is active) the kernel
is called as the registered op would call it, with the same result.
"""
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def may_call_kernel() -> bool:
    return (not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None)
