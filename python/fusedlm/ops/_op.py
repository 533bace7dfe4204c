"""One declaration per op: the Python side of ``fusedlm::<name>``.

An op's schema, its kernels' routing and its autograd are C++ (csrc/ops/<op file>.cpp): the
op is registered with torch's dispatcher, its kernel for CPU and CUDA tensors hands a call to
the backend its last argument names (a compiled kernel of the cpu or cuda backend, a Python
one of the triton or reference backend), and its autograd node, for the Autograd key, calls
the backward op through the dispatcher. An eager call is thus the public function (its
checks and the memoised choice of backend), then one call into the dispatcher, through the
op's compiled entry (csrc/ops/entry.h).

An op file states here what the C++ cannot: its plain-PyTorch reference and the reference
backend's kernels, its composition of PyTorch's own ops (the torch backend's, which runs in
place of the registered op: autograd records it), its probes, the fakes that give the
outputs' shapes under torch.compile, and what each backend's kernels take.

Conventions, stated here once:
- a kernel output that is absent (a gradient not asked for) is None in Python; it travels
  through the dispatcher as an empty tensor, as an op cannot return None
  (fusedlm.backends.filled);
- under a torch.func transform or forward-mode AD a call runs the reference backend's
  plain-PyTorch forward kernel instead, which every transform differentiates and batches; a
  gradient that is differentiated again (create_graph=True) or batched is the reference
  backward kernel's, which autograd records (:func:`reference_backward`, which the C++
  autograd calls).
"""
import sys
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch._C._functorch import peek_interpreter_stack
from torch.autograd import forward_ad

from .._extension import _C
from ..backends import OpInfo, declare, filled, kernel

_DECLARED: dict = {}  # {name: Op}


def _transformed() -> bool:
    """Whether the call runs under a torch.func transform or forward-mode AD, whose
    wrapped tensors and tangents only the reference's plain PyTorch takes everywhere."""
    return peek_interpreter_stack() is not None or forward_ad._current_level >= 0


def reference_backward(op: str, backend: str, dropout_p: float, *args,
                       caller: Optional[str] = None) -> tuple:
    """``op``'s backward where the backend's kernel cannot serve: for a gradient that is to be
    differentiated again (taken with create_graph=True), and for one taken under a torch.func
    transform (autograd.grad's is_grads_batched runs the backward under vmap), whose wrapped
    tensors no kernel reads. The reference backend's kernel, which recomputes it from the saved
    inputs in plain PyTorch that autograd records and transforms take. ``backend`` and
    ``dropout_p`` are the forward's; ``caller`` names the op the user called, where it borrows
    ``op``'s backward. Returns a tuple of gradients (None where absent); raises where the
    reference cannot stand in for the kernel."""
    twice = torch.is_grad_enabled()
    why = None
    if twice and not _DECLARED[op]._twice_differentiable:
        why = "its forward keeps only the gradient it took, not its inputs"
    elif backend != "reference" and dropout_p > 0:
        why = (f"with dropout_p > 0 on the {backend} backend, whose dropout mask the "
               "reference cannot redraw")
    if why is not None:
        what = ("double backward (differentiating a gradient taken with create_graph=True)"
                if twice else "a backward under a torch.func transform (a batched gradient)")
        raise RuntimeError(
            f"fusedlm: {caller or op}: {what} is not supported {why}. Calls made inside "
            "torch.func.grad, vjp or vmap run the op's plain-PyTorch composition, which "
            "supports it.")
    grads = _DECLARED[op]._reference_kernels[1](*args)
    return grads if isinstance(grads, tuple) else (grads,)


class Op:
    """``fusedlm::<name>`` (and ``fusedlm::<name>_backward`` once :meth:`differentiable`)."""

    def __init__(self, name: str, fake: Callable, *, reference: Callable,
                 reference_kernels: tuple, supports: Optional[dict] = None, probes: tuple = (),
                 composition: Optional[Callable] = None):
        """``fake``: the outputs' shapes, from the kernel's arguments; ``reference``: the op
        in plain PyTorch, with the public function's arguments (fusedlm.ops.reference.<name>);
        ``reference_kernels``: (forward, backward or None), the reference backend's kernels
        (fusedlm.backends.reference), with the arguments of the op's kernels (its schema's,
        without the backend); ``supports``: {backend: Supports} where the op's kernels on a
        backend take less than that backend's default (fusedlm.backends); ``probes``: its
        fusedlm.ops._probe.Probe problems."""
        self.name = name
        _DECLARED[name] = self
        # The plain-PyTorch kernels themselves (the reference backend's copy outputs that
        # alias inputs, which an op needs and a transform's wrapped tensors refuse).
        self._reference_kernels = reference_kernels
        self._twice_differentiable = False
        self._op = getattr(torch.ops.fusedlm, name).default
        # Eager calls enter the op through its compiled entry, which converts the arguments
        # by their C++ types (csrc/ops/entry.h) and hands the calls it does not take to
        # _fallback; torch.compile traces the OpOverload.
        self._eager = _C.op_entry(name, self._fallback)
        self.call = self._caller()
        _register_fake(name, fake)
        # The module of fusedlm.ops declaring the op (fusedlm.backends.triton finds its
        # kernels in the Triton module of the same name).
        module = sys._getframe(1).f_globals["__name__"].rpartition(".")[2]
        declare(OpInfo(name, module, supports or {}, reference, reference_kernels,
                       tuple(replace(p, op=name) for p in probes), composition))

    def _caller(self) -> Callable:
        """``call(backend, *args)``: the op's outputs on ``backend``. A function of its own
        rather than a method: it runs on every call, and a plain function costs Python least.
        The torch backend's composition runs as it is, outside the registered op; under a
        transform or forward-mode AD the reference's forward runs instead, as on every
        backend (SDPA lacks a forward-mode derivative on some devices)."""
        name, op, eager = self.name, self._op, self._eager
        is_compiling, reference_forward = torch.compiler.is_compiling, self._reference_kernels[0]

        def call(backend: str, *args):
            if backend == "torch":
                if _transformed():
                    return filled(reference_forward(*args), args)
                return kernel("torch", name).forward(*args)
            if is_compiling():
                return op(*args, backend)
            return eager(*args, backend)

        return call

    def _fallback(self, *args):
        """A call the compiled entry does not take (the backend last). Under a torch.func
        transform or forward-mode AD, the reference backend's plain-PyTorch forward kernel,
        which every transform takes (the kernels have no forward-mode or batching rules);
        otherwise the OpOverload, which honours torch function modes and tensors'
        __torch_function__."""
        if not _transformed():
            return self._op(*args)
        return filled(self._reference_kernels[0](*args[:-1]), args[:-1])

    def differentiable(self, fake: Optional[Callable], *, twice: bool = True) -> "Op":
        """Registers the fake of the backward op (None where the op has none: unpad's
        gradient is pad). ``twice``: the reference backward kernel, given what the forward
        saved, is a differentiable function of the op's inputs, so a double backward can run
        it (:func:`reference_backward`)."""
        if fake is not None:
            _register_fake(f"{self.name}_backward", fake)
        self._twice_differentiable = twice
        return self


def _register_fake(name: str, fake: Callable) -> None:
    def run_fake(*args):
        return filled(fake(*args[:-1]), args)

    torch.library.register_fake(f"fusedlm::{name}")(run_fake)
