#!/usr/bin/env bash
# Builds, tests and benchmarks fusedlm on a GPU machine, with that machine's own torch and
# triton (no network, no virtual environment).
#
#   scripts/gpu_check.sh STAGE [OUTDIR]
#   STAGE: quick | build | test | bench | bench-models | sanitize | all
#
# quick     a short lease's run, in QUICK_TIMEOUT seconds (default 540) for all its steps,
#           in the order of what users decide on: the build for sm_90a alone, the model
#           steps (bench --models bert-base gpt2-small modernbert-base llama-gqa), the op
#           rows at BERT-base's shapes (bench --shapes bert), the FFN's rows again on its
#           fused products (FUSEDLM_FFN_CUBLAS=0) and the attention's with its backward in
#           three kernels (FUSEDLM_ATTENTION_FUSED_BACKWARD=0), the record (benchmarks/results), then the
#           cuda cases of the op tests. Each bench step rewrites its JSON after every case,
#           so a step cut off keeps its rows. Without a GPU it is a dry run: a CPU build,
#           the bench steps with --device cpu --quick (checking them, measuring nothing)
#           and no record.
#
# build     compiles the extension in place with the CUDA kernels (MAX_JOBS=16), with
#           ptxas's resource report of every kernel (OUTDIR/ptxas.txt)
# test      fusedlm selftest (every kernel, dtype and path against the reference, small
#           and real shapes: OUTDIR/selftest.json), then the triton/cuda cases of every op's
#           tests on CUDA, small shapes and the gpu-marked real ones (over TEST_WORKERS=12
#           processes where pytest-xdist is installed)
# bench     fusedlm bench --device cuda --ops ...: every op on each GPU backend against
#           torch, with the device's ceilings; then the attention again with the cuda
#           backend's resident path off (rows "fusedlm[cuda] streamed") and with its
#           backward in three kernels ("fusedlm[cuda] three-kernel-backward"), the FFN on
#           its own fused products ("fusedlm[cuda] fused-ffn"), and the attention and the FFN
#           with their wgmma kernels off (rows "fusedlm[cuda] mma-sync")
# bench-models  the same for each model's steps; both stages' rows also go to one record,
#           benchmarks/results/<device>-<date>.json
# sanitize  compute-sanitizer memcheck and racecheck over a small run of every cuda kernel
#
# Logs, junit XML and JSON go to OUTDIR (default build/gpu-check); each stage, all of its
# steps together, is cut off after STAGE_TIMEOUT seconds (default 570): a step that
# finds the time spent is not run. A table of the steps run is printed last.
# Compiled Triton kernels are cached in build/triton-cache (TRITON_CACHE_DIR), so a stage
# run again, or a later stage, compiles only what is new. With PACK_TO=DIR, OUTDIR and
# benchmarks/results are also packed into one archive, DIR/gpu-check-STAGE.tgz, for a
# machine that sends back only a few files.
set -uo pipefail
cd "$(dirname "$0")/.."

STAGE=${1:-}
OUT=${2:-build/gpu-check}
PY=${PYTHON:-python3}
LIMIT=${STAGE_TIMEOUT:-570}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton-cache}
SUMMARY=()

run_stage() {  # name, command...: runs a step in the stage's time left, logging to OUT/<name>.log
  local name=$1; shift
  local start=$SECONDS status left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 10 ]; then
    echo "== $name: not run, the stage's $LIMIT s are spent" | tee "$OUT/$name.log"
    SUMMARY+=("$(printf '%-9s %-12s %5ss  %s' "$name" "not run" 0 "$OUT/$name.log")")
    return 124
  fi
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout "$left" "$@" 2>&1 | tee -a "$OUT/$name.log"
  status=${PIPESTATUS[0]}
  local verdict=ok
  [ "$status" -eq 124 ] && verdict="timed out"
  [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && verdict="failed ($status)"
  SUMMARY+=("$(printf '%-9s %-12s %5ss  %s' "$name" "$verdict" "$((SECONDS - start))" "$OUT/$name.log")")
  return "$status"
}

stage_build() {
  # ptxas's resource report (-v) of every kernel goes into the log; ptxas.txt keeps it alone.
  MAX_JOBS=${MAX_JOBS:-16} FUSEDLM_CUDA=${FUSEDLM_CUDA:-1} NVCC_APPEND_FLAGS="-Xptxas=-v" \
    run_stage build "$PY" setup.py build_ext --inplace || return
  grep -E "ptxas info|bytes stack frame" "$OUT/build.log" > "$OUT/ptxas.txt"
  echo "ptxas: $(grep -c "Compiling entry" "$OUT/ptxas.txt") kernels, the most registers" \
    "$(grep -o "Used [0-9]* registers" "$OUT/ptxas.txt" | sort -k2 -n | tail -1)," \
    "$(grep -c "[1-9][0-9]* bytes spill stores" "$OUT/ptxas.txt") with spills ($OUT/ptxas.txt)"
  "$PY" - "$OUT/build.json" <<'PYEOF'
import json, sys
import torch, fusedlm
from fusedlm import _build_info
info = {"torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "built_for": _build_info.cuda_arches, "backends": fusedlm.backends()}
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
PYEOF
}

write_record() {  # prints the name of the record written from OUT's bench*.json and variant-*.json
  # One record a device and day: the parts measured so far, rows and skips together.
  "$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
from fusedlm.bench.report import slug
out = Path(sys.argv[1])
parts = [json.loads(p.read_text()) for p in sorted(out.glob("bench*.json"))]
record = dict(parts[0], rows=[r for p in parts for r in p["rows"]],
              skipped=[s for p in parts for s in p["skipped"]],
              complete=all(p.get("complete", True) for p in parts))
for path in sorted(out.glob("variant-*.json")):  # their fusedlm[cuda] rows, named for it
    variant = path.stem.removeprefix("variant-")
    record["rows"] += [dict(r, impl=f"{r['impl']} {variant}")
                       for r in json.loads(path.read_text())["rows"] if r["impl"] == "fusedlm[cuda]"]
name = slug(record["device"]) + "-" + record["date"] + ".json"
Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
Path("benchmarks/results", name).write_text(json.dumps(record, indent=2) + "\n")
print(name)
PYEOF
}

stage_test() {
  # The op tests' cuda cases first (small shapes, no compiling: quick), then the gpu-marked
  # tests (every op's real shapes, BERT-base and GPT-2 small, on each GPU backend) and the
  # triton cases, which without TRITON_INTERPRET run on CUDA tensors. Compiling the triton kernels' specializations takes most of the
  # time: pytest-xdist, where installed, spreads them over the machine's cores.
  local status=0 workers=()
  run_stage selftest env -u TRITON_INTERPRET "$PY" -m fusedlm selftest --device cuda --size all \
      --json "$OUT/selftest.json" || status=$?
  run_stage test-cuda "$PY" -m pytest -q -p no:cacheprovider tests -m "not gpu and not triton" \
      -k "cuda" --junitxml="$OUT/test-cuda.xml" -rfE || status=$?
  "$PY" -c "import xdist" 2> /dev/null && workers=(-n "${TEST_WORKERS:-12}")
  run_stage test env -u TRITON_INTERPRET "$PY" -m pytest -q -p no:cacheprovider tests \
      -m "gpu or triton" ${workers[@]+"${workers[@]}"} --junitxml="$OUT/test-gpu-triton.xml" \
      -rfEs || status=$?
  return "$status"
}

stage_bench() {  # part: ops or models (one stage each, so that each fits a stage's time)
  local part=${1:-ops} stage=bench
  [ "$part" = models ] && stage=bench-models
  local names
  names=$("$PY" -c "import fusedlm.bench as b; print(*b.${part^^})") || return
  # The chart only where matplotlib is installed: the numbers matter more than the picture.
  local plot=()
  "$PY" -c "import matplotlib" 2> /dev/null && plot=(--plot "$OUT/$stage.png")
  # shellcheck disable=SC2086  # names is a list of words
  # bench rewrites its JSON after every case: a run cut off by the stage's time still
  # leaves its rows for the record below.
  local status=0
  run_stage "$stage" env -u TRITON_INTERPRET "$PY" -m fusedlm bench --device cuda --$part $names \
      --json "$OUT/$stage.json" ${plot[@]+"${plot[@]}"} || status=$?
  [ -f "$OUT/$stage.json" ] || return "$status"
  if [ "$part" = ops ] && [ "$status" -eq 0 ]; then
    # Ops again with cuda-backend paths off, each run against its own baselines: the
    # attention without its resident path (what it buys at BERT lengths), its backward in
    # three kernels instead of one up to 512 keys, the FFN on its own fused products
    # instead of cuBLAS's (wgmma on Hopper), and the attention and that product without
    # their wgmma kernels (what Hopper's products buy).
    # The record below is written whether or not these fit in the stage's time.
    run_stage bench-streamed env -u TRITON_INTERPRET FUSEDLM_ATTENTION_RESIDENT=0 "$PY" -m \
        fusedlm bench --device cuda --ops attention --json "$OUT/variant-streamed.json" \
        || status=$?
    run_stage bench-three-kernel-backward env -u TRITON_INTERPRET \
        FUSEDLM_ATTENTION_FUSED_BACKWARD=0 "$PY" -m fusedlm bench --device cuda --ops attention \
        --json "$OUT/variant-three-kernel-backward.json" || status=$?
    run_stage bench-fused-ffn env -u TRITON_INTERPRET FUSEDLM_FFN_CUBLAS=0 "$PY" -m \
        fusedlm bench --device cuda --ops gelu_ffn --json "$OUT/variant-fused-ffn.json" \
        || status=$?
    run_stage bench-mma-sync env -u TRITON_INTERPRET FUSEDLM_ATTENTION_WGMMA=0 \
        FUSEDLM_FFN_CUBLAS=0 FUSEDLM_FFN_WGMMA=0 "$PY" -m fusedlm bench --device cuda \
        --ops attention gelu_ffn --json "$OUT/variant-mma-sync.json" || status=$?
  fi
  local name
  name=$(write_record) || return
  echo "results: $OUT/$stage.json, benchmarks/results/$name"
  return "$status"
}

stage_sanitize() {
  # Every cuda kernel on the ops' small probes (scripts/cuda_sanitize_run.py --small), under
  # memcheck (out of bounds and misaligned accesses, leaks) and racecheck (shared-memory
  # hazards); the tests at full shapes would take hours under the sanitizer.
  if ! command -v compute-sanitizer > /dev/null; then
    echo "sanitize: compute-sanitizer is not on PATH" | tee "$OUT/sanitize.log"
    SUMMARY+=("$(printf '%-9s %-12s %5ss  %s' sanitize "failed" 0 "$OUT/sanitize.log")")
    return 1
  fi
  # Without the caching allocator every tensor is its own allocation, so memcheck also
  # sees a read past a tensor's end that would land in a neighbour's cached block.
  local status=0
  run_stage sanitize env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$PY" scripts/cuda_sanitize_run.py --small || status=$?
  run_stage racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$PY" scripts/cuda_sanitize_run.py --small || status=$?
  return "$status"
}

stage_quick() {
  local status=0 device=(--device cuda) ops
  ops=$("$PY" -c "import fusedlm.bench as b; print(*b.OPS)") || return
  if [ "$HAVE_GPU" = 1 ]; then
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} stage_build || return
  else
    echo "quick: no GPU here: a dry run (CPU build, bench --device cpu --quick, no record)"
    FUSEDLM_CUDA=0 stage_build || return
    device=(--device cpu --quick)
  fi
  run_stage bench-models env -u TRITON_INTERPRET "$PY" -m fusedlm bench "${device[@]}" \
      --models bert-base gpt2-small modernbert-base llama-gqa --json "$OUT/bench-models.json" \
      || status=$?
  # shellcheck disable=SC2086  # ops is a list of words
  run_stage bench env -u TRITON_INTERPRET "$PY" -m fusedlm bench "${device[@]}" --ops $ops \
      --shapes bert --json "$OUT/bench.json" || status=$?
  # The FFN on its own fused products, and the attention's backward in three kernels,
  # against the paths the rows above ran: the measurements that decide between them.
  run_stage bench-fused-ffn env -u TRITON_INTERPRET FUSEDLM_FFN_CUBLAS=0 "$PY" -m fusedlm bench \
      "${device[@]}" --ops gelu_ffn --shapes bert --json "$OUT/variant-fused-ffn.json" || status=$?
  run_stage bench-three-kernel-backward env -u TRITON_INTERPRET \
      FUSEDLM_ATTENTION_FUSED_BACKWARD=0 "$PY" -m fusedlm bench "${device[@]}" --ops attention \
      --shapes bert --json "$OUT/variant-three-kernel-backward.json" || status=$?
  local name
  if [ "$HAVE_GPU" = 1 ] && compgen -G "$OUT/bench*.json" > /dev/null; then
    if name=$(write_record); then echo "results: benchmarks/results/$name"; else status=1; fi
  fi
  run_stage test-cuda "$PY" -m pytest -q -p no:cacheprovider tests -m "not gpu and not triton" \
      -k "cuda" --junitxml="$OUT/test-cuda.xml" -rfE || status=$?
  return "$status"
}

staged() {  # stage function, arguments: runs it with STAGE_TIMEOUT seconds for all its steps
  DEADLINE=$((SECONDS + LIMIT))
  "$@"
}

HAVE_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2> /dev/null || echo 0)
status=0
case "$STAGE" in
  quick) LIMIT=${QUICK_TIMEOUT:-540} staged stage_quick || status=$? ;;
  build|test|bench|sanitize) staged "stage_$STAGE" || status=$? ;;
  bench-models) staged stage_bench models || status=$? ;;
  all) if staged stage_build; then
         for s in test bench sanitize; do staged "stage_$s" || status=$?; done
         staged stage_bench models || status=$?
       else
         status=1
       fi ;;
  *) echo "usage: $0 quick|build|test|bench|bench-models|sanitize|all [OUTDIR]" >&2; exit 2 ;;
esac

echo
printf '%-9s %-12s %6s  %s\n' stage result time log
printf '%s\n' "${SUMMARY[@]}"
for log in "$OUT/bench.log" "$OUT/bench-models.log"; do
  if [ -f "$log" ] && [[ "$STAGE" == bench* || "$STAGE" == all || "$STAGE" == quick ]]; then
    echo
    sed -n '/^benchmark /,$p' "$log"
  fi
done
if [ -n "${PACK_TO:-}" ]; then
  packed=("$(realpath --relative-to="$PWD" "$OUT")")
  [ -d benchmarks/results ] && packed+=(benchmarks/results)
  tar -czf "$PACK_TO/gpu-check-$STAGE.tgz" "${packed[@]}" && echo "packed: $PACK_TO/gpu-check-$STAGE.tgz"
fi
exit "$status"
