#!/usr/bin/env bash
# Command prefix for the offline GPU machine: installs the wheels prepared by
# shared/tools/gpu-wheels.sh (carried as .gpu/: flashinfer-python + deps, fa3.zip = vLLM's FA3 build)
# into /tmp/site, puts attnplug and /tmp/site on PYTHONPATH, then runs the arguments.
#
#   bash scripts/gpu_run.sh python -m pytest tests/core tests/gpu -q -rs
#   bash scripts/gpu_run.sh python -m attnplug.bench --out "$OUT/bench"
#   bash scripts/gpu_run.sh --all "$OUT"     # everything in one call (<= ~9.5 min worst case, ~5 typical), logs under $OUT:
#       FlashInfer JIT warm-up (background) || pytest tests/gpu tests/core -k "not flashinfer";
#       then pytest -k flashinfer; then the benchmark (JSON/markdown/PNG in $OUT/bench)
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
  set +e
  timeout 270 python3 -m attnplug.bench.jit_warmup >"$out/jit_warmup.log" 2>&1 &
  warm=$!
  timeout 240 python3 -m pytest tests/gpu tests/core -q -rs -k "not flashinfer" --timeout 120 \
    --junitxml="$out/pytest_triton_fa3.xml" 2>&1 | tee "$out/pytest_triton_fa3.log" | tail -n 60
  wait $warm; cat "$out/jit_warmup.log"
  timeout 130 python3 -m pytest tests/gpu -q -rs -k flashinfer --timeout 120 \
    --junitxml="$out/pytest_flashinfer.xml" 2>&1 | tee "$out/pytest_flashinfer.log" | tail -n 40
  timeout 150 python3 -m attnplug.bench --out "$out/bench" --time-budget 95 >"$out/bench.log" 2>&1
  echo "bench exit $?"; tail -n 75 "$out/bench.log"
  exit 0
fi
if [[ $# -gt 0 ]]; then exec "$@"; fi
