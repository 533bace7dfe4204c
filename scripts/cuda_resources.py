"""The resources of each compiled CUDA kernel, from ptxas's -v report in a build log:
registers, spilled bytes and the occupancy the registers allow, per kernel and arch.

    python scripts/cuda_resources.py build/cuda-check/ptxas.log [--json resources.json]

Prints the table, writes it as JSON if asked (`fusedlm bench --efficiency --resources`
shows it beside the emulator's counts), and exits 1 if a kernel breaks its budget below:
a kernel that spills, or that needs more registers than its budget, runs below the
occupancy its design assumes.
"""
import argparse
import json
import re
import subprocess
import sys
from typing import Dict, List

# Kernels (by a part of their name) with a register budget: at most 64 registers a thread
# lets 1024 threads of an SM run (half of its 2048); memory-bound row kernels need that
# many in flight.
REGISTER_BUDGETS = {"add_layer_norm_forward_kernel": 64, "add_layer_norm_backward_kernel": 64}

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


def over_budget(kernel: Dict) -> List[str]:
    problems = []
    for part, budget in REGISTER_BUDGETS.items():
        if part in kernel["kernel"]:
            if kernel["registers"] > budget:
                problems.append(f"{kernel['registers']} registers, over its budget of {budget}")
            if kernel["spill_bytes"]:
                problems.append(f"spills {kernel['spill_bytes']} bytes")
    return problems


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
        problems = over_budget(k)
        failed |= bool(problems)
        note = "  <- " + "; ".join(problems) if problems else ""
        print(f"{k['arch']:7} {k['registers']:4} {k['spill_bytes']:6} {k['occupancy']:9.0%}  "
              f"{k['kernel']}{note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(kernels, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
