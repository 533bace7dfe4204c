#!/usr/bin/env bash
# Compiles the cuda backend (kernels/cuda/*.cu and csrc/cuda/*.cu, the "cuda" group of
# sources.txt) for sm_80 and sm_90a against the installed PyTorch's headers (a
# CPU-only PyTorch is enough): a compile error fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PATH="$(dirname "$PY"):$PATH"  # the ninja that requirements-dev.txt installed
cmake -S . -B build/cuda-check -G Ninja -DPython_EXECUTABLE="$PY" >/dev/null
cmake --build build/cuda-check --target cuda_compile_check
