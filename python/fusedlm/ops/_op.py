"""One declaration per op: its torch.library custom op, fake and autograd, from one definition.

An op file states its op once: its plain-PyTorch reference and the reference backend's
kernels, its probes, the kernels' schema (without the trailing ``str backend``,
which this adds), the fake that gives the outputs' shapes under torch.compile, and, for a
differentiable op, the backward kernels' schema and fake, what the forward saves
(``setup``) and how its gradient is taken (``grad``). Every backend, the plain-PyTorch
reference included, supplies kernels of exactly these schemas (fusedlm.backends), so a
call runs the same way on each: ``OP(backend, *args)``.

Conventions, stated here once:
- a kernel output that is absent (a gradient not asked for) is None; it travels as an
  empty tensor, as custom ops cannot return None;
- ``grad`` returns the gradients of the leading inputs only; the rest are None.

The registered op is what torch.compile and dispatch modes (fake tensors) see. Under a
torch.func transform or forward-mode AD a call runs the reference backend's plain-PyTorch
forward kernel instead, which every transform differentiates and batches; a gradient that
is differentiated again (create_graph=True) or batched is the reference backward kernel's,
which autograd records (reference_backward). In plain eager code nothing observes the
difference, and its Python dispatch is costly (about 100 µs a forward and backward on a
CPU, several times the kernels' own time at BERT sizes on a GPU): there a call goes straight to the backend's kernel, under a plain
``torch.autograd.Function`` with the same setup and gradient where autograd records it, or
through the backend's own autograd node where it has one (``Kernel.autograd``: the cpu
backend's add_layer_norm and bias_gelu, whose nodes in C++ record the same saved tensors and
gradients without Python in the forward or the backward). Those two ops go further on the
CPU once dispatch has settled: their public function hands the whole call to the backend's
eager lane first (``Kernel.eager``, fusedlm.backends.lane), checks and node in one C++ call.
"""
import sys
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch._C._functorch import is_legacy_batchedtensor

from ..backends import OpInfo, declare, kernel, transformed, unobserved


def _with_backend(schema: str) -> str:
    arguments, arrow, returns = schema.rpartition(") ->")
    return f"{arguments}, str backend{arrow}{returns}"


def _filled(outputs, args):
    """outputs with each None replaced by an empty tensor like the first tensor argument."""
    if not isinstance(outputs, tuple):
        return outputs
    for o in outputs:  # (on every call: a plain loop, which costs least when none is None)
        if o is None:
            break
    else:
        return outputs
    like = next(a for a in args if isinstance(a, torch.Tensor))
    return tuple(like.new_empty(0) if o is None else o for o in outputs)


def _direct_function(op: "Op", backend: str) -> type:
    """The torch.autograd.Function that runs ``op``'s kernels on ``backend`` directly in
    eager code, with the op's own setup and gradient. One class per op and backend, made
    once, so that a call passes autograd only the op's own inputs."""
    def forward(ctx, *args):
        outputs = _filled(kernel(backend, op.name).forward(*args), args)
        ctx.op, ctx.backend, ctx.direct = op.name, backend, True
        op._setup(ctx, args, outputs)
        return outputs

    def backward(ctx, *grads):
        ctx.kernels_serve = kernels_serve(grads)
        taken = op._grad(ctx, *grads)
        return (*taken, *(None,) * (op._arguments - 1 - len(taken)))

    return type(f"{op.name}_{backend}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_DECLARED: dict = {}  # {name: Op}


def kernels_serve(grads: tuple) -> bool:
    """Whether a backend's backward kernel can take the backward of these output gradients:
    not where the gradient is to be differentiated again (create_graph=True), which a
    kernel would not record, nor under a torch.func transform or autograd's own vmap
    (autograd.grad's is_grads_batched), whose wrapped tensors no kernel reads. Those run
    :func:`reference_backward`."""
    return not (torch.is_grad_enabled() or transformed()
                or any(g is not None and is_legacy_batchedtensor(g) for g in grads))


def reference_backward(op: str, backend: str, dropout_p: float, *args,
                       caller: Optional[str] = None) -> tuple:
    """``op``'s backward where the backend's kernel cannot serve: for a gradient that is to be
    differentiated again (taken with create_graph=True), and for one taken under a torch.func
    transform (autograd.grad's is_grads_batched runs the backward under vmap), whose wrapped
    tensors no kernel reads. The reference backend's kernel, which recomputes it from the saved
    inputs in plain PyTorch that autograd records and transforms take. ``backend`` and
    ``dropout_p`` are the forward's; ``caller`` names the op the user called, where it borrows
    ``op``'s backward. Raises where the reference cannot stand in for the kernel."""
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
    return _DECLARED[op]._reference_kernels[1](*args)


class Op:
    """``fusedlm::<name>`` (and ``fusedlm::<name>_backward`` once :meth:`differentiable`)."""

    def __init__(self, name: str, schema: str, fake: Callable, *, reference: Callable,
                 reference_kernels: tuple, mutates: tuple = (), supports: Optional[dict] = None,
                 probes: tuple = ()):
        """``reference``: the op in plain PyTorch, with the public function's arguments
        (fusedlm.ops.reference.<name>); ``reference_kernels``: (forward, backward or None),
        the reference backend's kernels of the op's schemas (fusedlm.backends.reference);
        ``supports``: {backend: Supports} where the op's kernels on a backend take less
        than that backend's default (fusedlm.backends); ``probes``: its
        fusedlm.backends.probes.Probe problems."""
        self.name = name
        _DECLARED[name] = self
        # The plain-PyTorch kernels themselves (the reference backend's copy outputs that
        # alias inputs, which a registered op needs and a transform's wrapped tensors refuse).
        self._reference_kernels = reference_kernels
        # The module of fusedlm.ops declaring the op (fusedlm.backends.triton finds its
        # kernels in the Triton module of the same name).
        module = sys._getframe(1).f_globals["__name__"].rpartition(".")[2]
        # {backend forced or None: eager lane} (fusedlm.backends.lane)
        self.lanes = declare(OpInfo(name, module, supports or {}, reference, reference_kernels,
                                    tuple(replace(p, op=name) for p in probes)))
        self._arguments = len(torch._C.parse_schema(f"fusedlm::{name}{_with_backend(schema)}").arguments)
        self._forward = self._register(name, schema, fake, lambda backend: kernel(backend, name).forward,
                                       mutates)
        self._backward: Optional[torch.library.CustomOpDef] = None
        self._setup: Optional[Callable] = None  # set by differentiable()
        self._grad: Optional[Callable] = None
        self._twice_differentiable = False
        self._direct: dict = {}  # {backend: its _direct_function}

    def __call__(self, backend: str, *args):
        """The op's outputs on ``backend``."""
        if unobserved():
            found = kernel(backend, self.name)
            if not torch.is_grad_enabled():
                return _filled(found.forward(*args), args)
            if found.autograd is not None:
                return found.autograd(*args)
            if self._grad is not None:
                direct = self._direct.get(backend)
                if direct is None:
                    direct = self._direct[backend] = _direct_function(self, backend)
                return direct.apply(*args)
        elif transformed():
            return _filled(self._reference_kernels[0](*args), args)
        return self._forward(*args, backend)

    def backward(self, ctx, *args):
        """The backward kernel, on the backend the forward ran on; for a gradient that is to
        be differentiated again or is batched, :func:`reference_backward`."""
        if not ctx.kernels_serve:
            return _filled(reference_backward(self.name, ctx.backend,
                                              getattr(ctx, "dropout_p", 0.0), *args,
                                              caller=ctx.op), args)
        if getattr(ctx, "direct", False):
            return _filled(kernel(ctx.backend, self.name).backward(*args), args)
        return self._backward(*args, ctx.backend)

    def differentiable(self, schema: Optional[str], fake: Optional[Callable], setup: Callable,
                       grad: Callable, *, twice: bool = True) -> "Op":
        """Registers the backward kernel (of ``schema``; None where the gradient is another
        op's forward, as unpad's is pad) and the autograd formula.

        ``setup(ctx, inputs, outputs)`` saves what ``grad(ctx, *output_grads)`` needs; both see
        the inputs without the backend (``ctx.backend`` holds it). ``twice``: the reference
        backward kernel, given what ``setup`` saved, is a differentiable function of the
        op's inputs, so a double backward can run it (:meth:`backward`)."""
        name = self.name
        self._setup, self._grad, self._twice_differentiable = setup, grad, twice
        if schema is not None:
            self._backward = self._register(f"{name}_backward", schema, fake,
                                            lambda backend: kernel(backend, name).backward)
        def setup_context(ctx, inputs, output):
            ctx.op, ctx.backend = name, inputs[-1]
            setup(ctx, inputs[:-1], output)

        def backward(ctx, *grads):
            ctx.kernels_serve = kernels_serve(grads)
            taken = grad(ctx, *grads)
            return (*taken, *(None,) * (self._arguments - len(taken)))

        self._forward.register_autograd(backward, setup_context=setup_context)
        return self

    @staticmethod
    def _register(name: str, schema: str, fake: Callable, implementation: Callable,
                  mutates: tuple = ()) -> torch.library.CustomOpDef:
        def run(*args):
            return _filled(implementation(args[-1])(*args[:-1]), args)

        def run_fake(*args):
            return _filled(fake(*args[:-1]), args)

        op = torch.library.custom_op(f"fusedlm::{name}", run, mutates_args=mutates,
                                     schema=_with_backend(schema))
        op.register_fake(run_fake)
        return op
