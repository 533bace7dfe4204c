"""fusedlm info: what this installation can run."""
from __future__ import annotations

import argparse
import platform


HELP = "versions, backends and devices"
DESCRIPTION = """Prints fusedlm's version, which backends can run and why not, the CUDA
architectures compiled in (or emulated), the torch and triton versions, the devices found
(and why the cuda kernels cannot run on one), where kernel checks keep their results, and
every environment switch fusedlm reads, with its value in effect (fusedlm.switches)."""


def run(args: argparse.Namespace) -> int:
    import torch

    import fusedlm
    from fusedlm import _build_info
    from fusedlm.backends import cuda as cuda_backend
    from fusedlm import switches, verify

    # A FUSEDLM_CUDA=emulate build compiles the CUDA kernels against a CPU emulator of CUDA.
    emulated = getattr(_build_info, "cuda_emulated", False)
    arch = cuda_backend.emulated_arch()
    lines = [("fusedlm", fusedlm.__version__),
             ("python", platform.python_version()),
             ("torch", torch.__version__ + (f" (CUDA {torch.version.cuda})" if torch.version.cuda
                                            else "")),
             ("triton", _version("triton")),
             ("compiled against", f"torch {_build_info.torch_version}, CUDA "
                                  + ("emulated on the CPU" if emulated
                                     else _build_info.cuda_version or "none")),
             ("CUDA arches", f"{arch}, emulated (FUSEDLM_EMULATE_ARCH=sm_80 or sm_90a)" if arch
              else _build_info.cuda_arches or "none")]
    for name, ok in fusedlm.backends().items():
        lines.append((f"backend {name}", _status(ok)))
    lines.append(("device", _devices(torch, cuda_backend)))
    lines.append(("kernel checks", f"at first use, results in {verify.cache_folder()}" if verify.enabled()
                  else "off (FUSEDLM_VERIFY=0)"))
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    print("\nenvironment switches:")
    table = [(s.name, value if value is not None else f"unset: {s.default}",
              f"{s.what}; read by {s.read_by}")
             for s, value in switches.in_effect()]
    widths = [max(len(row[i]) for row in table) for i in range(2)]
    for name, value, what in table:
        print(f"  {name:<{widths[0]}}  {value:<{widths[1]}}  {what}")
    return 0


def _status(ok) -> str:
    """A backend's line: fusedlm.backends()'s True, Emulated string or reason."""
    from fusedlm.backends import Emulated

    if ok is True:
        return "available"
    if isinstance(ok, Emulated):
        return f"available, {ok} (on CPU tensors, only when named)"
    return f"unavailable: {ok}"


def _version(module: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices(torch, cuda_backend) -> str:
    if torch.cuda.is_available():
        names = []
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            refused = cuda_backend.refuses_device(torch.device("cuda", i))
            names.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})"
                         + (f": no cuda kernels, {refused}" if refused else ""))
        return ", ".join(names)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
