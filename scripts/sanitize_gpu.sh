#!/usr/bin/env bash
# compute-sanitizer memcheck over the kernel test batches (issue 17 §3), on a CUDA GPU (the H200):
# ragged batches at pages 1 and 16, 16k-token contexts, CUDA-graph replays with padding, for every
# provider that loads (triton, flashinfer, fa3) - scripts/sanitize_batches.py - then prints the error
# count. Two runs per tool: the eager batches with the caching allocator off
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own allocation, so an access past its end is
# an error, not a read of a neighbour in the same pool), then the graph replays with it on (capture
# needs the allocator's private pools: without them a library's allocation inside the capture, e.g.
# FA3's LSE, is a cudaMalloc, which stream capture forbids).
#
#   bash scripts/gpu_run.sh bash scripts/sanitize_gpu.sh "$OUT"          # device tool, carry .gpu
#   SANITIZE_TOOLS="memcheck initcheck" bash scripts/sanitize_gpu.sh OUT  # more tools, one run each
#   SANITIZE_ARGS="--quick" ...                                          # fewer shapes
#
# Writes OUT/sanitize-<tool>.log (sanitizer + script output) and OUT/sanitize-summary.txt; exit 0 only
# when every tool reports 0 errors and every numeric check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/attnplug-sanitize}}
mkdir -p "$out"
tools=${SANITIZE_TOOLS:-memcheck}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [[ ! -x $CS ]]; then
  echo "sanitize_gpu.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee "$out/sanitize-summary.txt"
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
: > "$out/sanitize-summary.txt"
for tool in $tools; do
 for part in eager graphs; do
  log="$out/sanitize-$tool-$part.log"
  extra=()
  [[ $tool == memcheck ]] && extra=(--leak-check no)
  envs=(env -u PYTORCH_NO_CUDA_MEMORY_CACHING)  # (presence alone turns caching off in some torch releases)
  [[ $part == eager ]] && envs=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  # --target-processes all: Triton compiles in subprocesses; the kernels run in the main one
  "${envs[@]}" timeout "${SANITIZE_TIMEOUT:-3000}" "$CS" --tool "$tool" "${extra[@]}" \
    --target-processes all --print-limit 200 python3 scripts/sanitize_batches.py --parts "$part" ${SANITIZE_ARGS:-} \
    > "$log" 2>&1
  rc=$?
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | awk '{s += $3} END {print s + 0}')
  checks=$(grep -Eo 'sanitize_batches: [0-9]+ failed checks' "$log" | tail -1 | awk '{print $2}')
  line="compute-sanitizer $tool ($part): $errors errors; script exit $rc; failed numeric checks: ${checks:-?} (log: $log)"
  echo "$line" | tee -a "$out/sanitize-summary.txt"
  [[ $errors -eq 0 && $rc -eq 0 ]] || status=1
 done
done
exit $status
