"""The resources of each compiled CUDA kernel, from ptxas's -v report in a build log:
registers, spilled bytes and the occupancy the registers allow, per kernel and arch.

    python scripts/cuda_resources.py build/cuda-check/ptxas.log [--json resources.json]

Prints the table, writes it as JSON if asked (`fusedlm bench --efficiency --resources`
shows it beside the emulator's counts), and exits 1 if a kernel spills. A kernel's register
budget is its own `__launch_bounds__`, which ptxas meets by spilling where it must (the
row-wise kernels' 1024 threads leave 64 registers a thread): a spill is a kernel running
below the occupancy its design assumes, or waiting on local memory.
"""
import argparse
import json
import re
import subprocess
import sys
from typing import Dict, List

REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64  # sm_80 and sm_90
ALLOCATION_UNIT = 256  # registers are given to a warp in units of 256


def demangle(names: List[str]) -> List[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [re.sub(r"\(.*\)$", "", re.sub(r"fusedlm::cuda::(kernels::\w+::)?", "", n))
            .removeprefix("void ") for n in out]


def occupancy(registers: int) -> float:
    """The share of an SM's warps that can be resident when each thread has `registers`."""
    per_warp = -(-registers * 32 // ALLOCATION_UNIT) * ALLOCATION_UNIT
    return min(MAX_WARPS_PER_SM, REGISTERS_PER_SM // max(per_warp, 1)) / MAX_WARPS_PER_SM


def parse(log: str) -> List[Dict]:
    """One entry per kernel and arch that ptxas compiled, in the log's order."""
    kernels, entry = [], None
    for line in log.splitlines():
        match = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
        if match:
            entry = {"symbol": match[1], "arch": match[2], "spill_bytes": 0}
            continue
        if entry is None:
            continue
        match = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match:
            entry["spill_bytes"] = int(match[1]) + int(match[2])
        match = re.search(r"Used (\d+) registers", line)
        if match:
            entry["registers"] = int(match[1])
            entry["occupancy"] = occupancy(entry["registers"])
            kernels.append(entry)
            entry = None
    # A source compiled twice (the same kernel in two objects) is one kernel.
    unique = {(k["symbol"], k["arch"]): k for k in kernels}
    kernels = list(unique.values())
    for k, name in zip(kernels, demangle([k["symbol"] for k in kernels])):
        k["kernel"] = name
    return kernels


def problems(kernel: Dict) -> List[str]:
    return [f"spills {kernel['spill_bytes']} bytes"] if kernel["spill_bytes"] else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a build log with ptxas -v output")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    with open(args.log) as f:
        kernels = parse(f.read())
    if not kernels:
        print(f"{args.log}: no ptxas -v report found", file=sys.stderr)
        return 1
    failed = False
    print(f"{'arch':7} {'regs':>4} {'spill':>6} {'occupancy':>9}  kernel")
    for k in sorted(kernels, key=lambda k: (k["kernel"], k["arch"])):
        found = problems(k)
        failed |= bool(found)
        note = "  <- " + "; ".join(found) if found else ""
        print(f"{k['arch']:7} {k['registers']:4} {k['spill_bytes']:6} {k['occupancy']:9.0%}  "
              f"{k['kernel']}{note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(kernels, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
