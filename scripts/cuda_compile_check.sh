#!/usr/bin/env bash
# Compiles the cuda backend (kernels/cuda/*.cu and csrc/cuda/*.cu, the "cuda" group of
# sources.txt) for sm_80 and sm_90a against the installed PyTorch's headers (a
# CPU-only PyTorch is enough), then reports each kernel's registers, spills and the
# occupancy they allow (scripts/cuda_resources.py, also written to
# build/cuda-check/resources.json). A compile error, or a kernel that spills, fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PATH="$(dirname "$PY"):$PATH"  # the ninja that requirements-dev.txt installed
cmake -S . -B build/cuda-check -G Ninja -DPython_EXECUTABLE="$PY" >/dev/null
# From scratch: ptxas reports only on what it compiles.
ninja -C build/cuda-check -t clean cuda_compile_check >/dev/null
if ! cmake --build build/cuda-check --target cuda_compile_check >build/cuda-check/ptxas.log 2>&1; then
  grep -v "^ptxas info\|^    [0-9]* bytes stack frame" build/cuda-check/ptxas.log
  exit 1
fi
"$PY" scripts/cuda_resources.py build/cuda-check/ptxas.log --json build/cuda-check/resources.json
