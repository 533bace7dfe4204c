"""Prints the speed-up table of a pytest-benchmark JSON file as Markdown.

    python benchmarks/report.py results.json

For every group, each baseline's fastest round divided by fusedlm's fastest round:
above 1.0 fusedlm is faster. The fastest round, not the median: on a shared machine
other processes only ever add time, so the minimum is the least disturbed estimate.
"""
import json
import sys
from collections import defaultdict


def table(path: str) -> str:
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    groups = defaultdict(dict)
    for run in runs:
        groups[run["group"]][run["extra_info"]["impl"]] = run["stats"]["min"]
    lines = ["| op and pass | fusedlm (ms) | baseline | baseline (ms) | speed-up |", "|---|---:|---|---:|---:|"]
    for group in sorted(groups):
        times = groups[group]
        ours = times.get("fusedlm")
        for name, t in sorted(times.items()):
            if name == "fusedlm" or ours is None:
                continue
            lines.append(f"| {group} | {ours * 1e3:.3f} | {name} | {t * 1e3:.3f} | {t / ours:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
