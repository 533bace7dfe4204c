"""A run of every cuda-backend kernel, forward and backward, for compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/cuda_sanitize_run.py [--small]

The calls are the ops' own probes (fusedlm/ops/<op>.py), small and real, each in every
dtype the op's cuda kernels take: once as declared, checked against the reference as
verification at first use checks them, and once more with dropout where the op has it.
A probe that names kernel paths runs again with them turned off one after another, as
their declaration orders them (so the paths a path replaces run too). The probes take the
kernels through their vector and one-element rows, rows past the layer norms' register
cache, ignored labels, the masked-LM chunks, attention's one-kernel and three-kernel
backward, its resident and streamed walks and partial blocks, and the FFN's partial tiles.

It exits non-zero when the cuda backend cannot run or a probe's result is off. On a
FUSEDLM_CUDA=emulate build it runs on the CPU emulator (`--small`: the small probes only),
which checks memory accesses itself.
"""
import argparse
import inspect
import sys

import torch

import fusedlm
from fusedlm.backends import Emulated, cuda as cuda_backend, declared, kernel
from fusedlm.verify import probes

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DROPOUT = 0.1


def path_settings(probe) -> list:
    """The probe's kernel paths turned off one after another: [(), (p1,), (p1, p2), ...]."""
    return [probe.paths[:n] for n in range(len(probe.paths) + 1)]


def inputs(probe, device, dtype) -> tuple:
    """The probe's (args, kwargs) on device, its floating tensors in dtype, as leaves."""
    args, kwargs = probe.make(torch.Generator().manual_seed(0))
    args = [(a.to(device, dtype).requires_grad_() if a.is_floating_point() else a.to(device))
            if isinstance(a, torch.Tensor) else a for a in args]
    return args, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def with_dropout(probe, device, dtype) -> None:
    """One forward and backward of the probe with dropout_p = DROPOUT (no values checked:
    the reference cannot redraw the kernels' mask)."""
    args, kwargs = inputs(probe, device, dtype)
    outputs = getattr(fusedlm.ops, probe.op)(*args, dropout_p=DROPOUT, backend="cuda", **kwargs)
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,))
               if o.requires_grad]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)


def taken(probe, device, dtype) -> bool:
    """Whether the op's cuda kernels take the probe in dtype (else automatic choice would
    hand it to another backend)."""
    args, kwargs = inputs(probe, device, dtype)
    try:
        fusedlm.explain(probe.op, *args, backend="cuda", **kwargs)
    except RuntimeError:
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="only the small probes")
    small = parser.parse_args(argv).small
    status = fusedlm.backends()["cuda"]
    if status is not True and not isinstance(status, Emulated):
        print(f"the cuda backend cannot run: {status}", file=sys.stderr)
        return 1
    device = torch.device("cpu" if cuda_backend.emulated() else "cuda")
    failures = []
    for op in declared():
        try:
            kernel("cuda", op)
        except KeyError:
            continue
        drops = "dropout_p" in inspect.signature(getattr(fusedlm.ops, op)).parameters
        for probe in probes.probes(op) + ([] if small else probes.probes(op, "real")):
            for dtype in (d for d in DTYPES if taken(probe, device, d)):
                for off in path_settings(probe):
                    for name in probe.paths:
                        cuda_backend.set_path(name, name not in off)
                    outcome = probes.run(probe, "cuda", device, dtype)
                    what = f"{op}, {probe.name}, {str(dtype)[6:]}"
                    what += f", {' and '.join(off)} off" if off else ""
                    print(f"{what}: {outcome.error:.2g} ({outcome.worst})")
                    if not outcome.within(dtype):
                        failures.append(what)
                    if drops:
                        with_dropout(probe, device, dtype)
                for name in probe.paths:
                    cuda_backend.set_path(name, True)
    if device.type == "cuda":
        fusedlm._C.cuda.dropout_mask(torch.tensor(3), 5, [3, 7], 0.5, torch.cuda.current_device())
        torch.cuda.synchronize()
    if failures:
        print("off the reference: " + "; ".join(failures), file=sys.stderr)
        return 1
    print("ran every cuda kernel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
