#!/usr/bin/env bash
# Command prefix for the offline GPU machine: installs the wheels prepared by
# shared/tools/gpu-wheels.sh (carried as .gpu/: flashinfer-python + deps, fa3.zip = vLLM's FA3 build)
# into /tmp/site, puts attnplug and /tmp/site on PYTHONPATH, then runs the arguments.
#
#   bash scripts/gpu_run.sh python -m pytest tests/core tests/gpu -q -rs
#   bash scripts/gpu_run.sh python -m attnplug.bench --out "$OUT/bench"
#   ATTNPLUG_FAIL_LOG=$OUT/failures.txt (tests/conftest.py): each failure's traceback as it happens
#   bash scripts/gpu_run.sh --all "$OUT"     # everything in one call (~9.5 min: with the bench past the 10-min call limit, so ATTNPLUG_GPU_BENCH=true and the bench in a call of its own), logs under $OUT:
#       FlashInfer JIT warm-up (background) || pytest tests/gpu tests/core -k "not flashinfer";
#       then pytest -k flashinfer; then the benchmark (JSON/markdown/PNG in $OUT/bench).
#       Exits 1 when any of the three steps fails (non-zero exit, timeout: 124); writes
#       $OUT/summary.txt (one line a step + overall) and $OUT/gpu_run.junit.xml (one case a step;
#       each pytest step also writes its own junit). ATTNPLUG_GPU_SELFTEST_FAIL=1 adds a failing test
#       (tests/gpu/test_gpu_selftest.py) to show the non-zero exit. Overridable: ATTNPLUG_GPU_TEST_PATHS,
#       ATTNPLUG_GPU_FI_PATHS, ATTNPLUG_GPU_{MAIN,FI,BENCH}_TIMEOUT (s), ATTNPLUG_GPU_BENCH_BUDGET (s).
#
# Idempotent: a second call on a still-warm machine skips the install. FlashInfer's JIT cache goes to
# $FLASHINFER_WORKSPACE_BASE (default /tmp/attnplug-fi), so it is also reused while the machine is warm.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=${ATTNPLUG_GPU_DIR:-.gpu}
SITE=${ATTNPLUG_SITE:-/tmp/site}
if [[ ! -f $SITE/.attnplug-installed ]]; then
  if compgen -G "$GPU_DIR/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$GPU_DIR"/*.whl
  else
    echo "gpu_run.sh: no wheels in $GPU_DIR (run shared/tools/gpu-wheels.sh and carry .gpu); flashinfer will be unavailable" >&2
  fi
  if [[ -f $GPU_DIR/fa3.zip ]]; then
    python3 -m zipfile -e "$GPU_DIR/fa3.zip" "$SITE"  # no `unzip` there
  else
    echo "gpu_run.sh: no $GPU_DIR/fa3.zip; fa3 will be unavailable" >&2
  fi
  mkdir -p "$SITE" && touch "$SITE/.attnplug-installed"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/attnplug-fi}
python3 - <<'PY' || true
import torch
print(f"gpu_run.sh: torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA'}", flush=True)
for mod in ("triton", "flashinfer"):
    try:
        print(f"gpu_run.sh: {mod} {__import__(mod).__version__}", flush=True)
    except Exception as e:
        print(f"gpu_run.sh: {mod} import failed: {e!r}", flush=True)
try:
    from attnplug.core.providers.fa3 import load_fa3
    print(f"gpu_run.sh: fa3 via {load_fa3().source}", flush=True)
except Exception as e:
    print(f"gpu_run.sh: fa3 unavailable: {e}", flush=True)
PY
if [[ ${1:-} == --all ]]; then
  out=${2:-${OUT:-/tmp/attnplug-out}}; mkdir -p "$out"
  # Commands (overridable, plain words, no quoting: tests/core/test_gpu_run_script.py runs this on CPU
  # with stand-ins).
  read -ra PYTEST <<< "${ATTNPLUG_GPU_PYTEST:-python3 -m pytest}"
  read -ra BENCH <<< "${ATTNPLUG_GPU_BENCH:-python3 -m attnplug.bench}"
  read -ra WARMUP <<< "${ATTNPLUG_GPU_WARMUP:-python3 -m attnplug.bench.jit_warmup}"
  read -ra TEST_PATHS <<< "${ATTNPLUG_GPU_TEST_PATHS:-tests/gpu tests/core}"
  read -ra FI_PATHS <<< "${ATTNPLUG_GPU_FI_PATHS:-tests/gpu}"
  # per-step limits (s) and the bench's own time budget, overridable for a session's batched call
  t_main=${ATTNPLUG_GPU_MAIN_TIMEOUT:-300} t_fi=${ATTNPLUG_GPU_FI_TIMEOUT:-250}
  t_bench=${ATTNPLUG_GPU_BENCH_TIMEOUT:-150} budget=${ATTNPLUG_GPU_BENCH_BUDGET:-95}
  PYTEST_ARGS=()  # a per-test timeout when pytest-timeout is installed (it is in the GPU bundle), workers below
  help=$("${PYTEST[@]}" --help 2>/dev/null || true)
  [[ $help == *"--timeout="* ]] && PYTEST_ARGS=(--timeout 120)
  # pytest-xdist (carry its wheels in .gpu/): 8 workers share the GPU and compile in parallel (~1.7x the
  # tests in the same time on the H200); -v streams each test's verdict, so a step cut by its time
  # limit still names what failed
  [[ $help == *"--numprocesses"* && -z ${ATTNPLUG_GPU_PYTEST:-} ]] && PYTEST_ARGS+=(-n 8)
  summary=$out/summary.txt; : > "$summary"
  names=(); rcs=(); secs=()
  # step NAME TIMEOUT LOG CMD...: run, keep its exit status (timeout: 124), show the log's tail
  step() {
    local name=$1 limit=$2 log=$3 t0=$SECONDS rc; shift 3
    timeout "$limit" "$@" >"$log" 2>&1; rc=$?
    tail -n 60 "$log"
    names+=("$name"); rcs+=("$rc"); secs+=($((SECONDS - t0)))
    printf '%-17s %s (exit %s, %ss, log %s)\n' "$name" "$( ((rc == 0)) && echo PASS || echo FAIL)" "$rc" \
      $((SECONDS - t0)) "$(basename "$log")" >>"$summary"
    echo "gpu_run.sh: $name exit $rc"
  }
  set +e
  timeout "$t_main" "${WARMUP[@]}" >"$out/jit_warmup.log" 2>&1 &
  warm=$!
  step pytest_main "$t_main" "$out/pytest_triton_fa3.log" "${PYTEST[@]}" "${TEST_PATHS[@]}" -v -rfEs -k "not flashinfer" -m "not network" \
    "${PYTEST_ARGS[@]}" --junitxml="$out/pytest_triton_fa3.xml"
  wait $warm; echo "jit warm-up exit $? (informational)"; tail -n 20 "$out/jit_warmup.log"
  step pytest_flashinfer "$t_fi" "$out/pytest_flashinfer.log" "${PYTEST[@]}" "${FI_PATHS[@]}" -v -rfEs -k flashinfer -m "not network" \
    "${PYTEST_ARGS[@]}" --junitxml="$out/pytest_flashinfer.xml"
  step bench "$t_bench" "$out/bench.log" "${BENCH[@]}" --out "$out/bench" --time-budget "$budget"
  set -e
  failed=0
  for rc in "${rcs[@]}"; do ((rc == 0)) || failed=$((failed + 1)); done
  echo "overall: $( ((failed == 0)) && echo PASS || echo FAIL) ($failed of ${#rcs[@]} steps failed)" >>"$summary"
  # one junit file over the steps (each pytest step also wrote its own, per test)
  python3 - "$out/gpu_run.junit.xml" "$failed" "${#rcs[@]}" "${names[@]}" "${rcs[@]}" "${secs[@]}" <<'PY'
import sys
from xml.sax.saxutils import quoteattr
path, failed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names, rcs, secs = sys.argv[4:4 + n], sys.argv[4 + n:4 + 2 * n], sys.argv[4 + 2 * n:4 + 3 * n]
cases = []
for name, rc, s in zip(names, rcs, secs):
    body = "" if rc == "0" else f'<failure message={quoteattr(f"exit status {rc}")}/>'
    cases.append(f'  <testcase classname="gpu_run" name={quoteattr(name)} time="{s}">{body}</testcase>')
with open(path, "w") as f:
    f.write(f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="gpu_run" tests="{n}" failures="{failed}">\n')
    f.write("\n".join(cases) + "\n</testsuite>\n")
PY
  echo "=== gpu_run.sh summary ($summary) ==="; cat "$summary"
  ((failed == 0)) || exit 1
  exit 0
fi
if [[ $# -gt 0 ]]; then exec "$@"; fi
