#!/usr/bin/env bash
# Build (idempotently) the CPU-only SGLang 0.5.23 test environment in .venvs/sglang.
# torch 2.14.1 (brings triton), SGLang's pure-Python deps, sglang itself with --no-deps (its GPU-only
# deps such as sglang-kernel / flashinfer are deliberately NOT installed), pytest, and attnplug (editable).
# The CPU stand-in for sgl_kernel lives in tests/sglang/sgl_kernel_shim/ and is put on PYTHONPATH by the tests only.
# Another release (scripts/setup_sglang0517_env.sh): SGLANG_VERSION, SGLANG_PINS (its own pins that
# differ from requirements-cpu.txt, space-separated), SGLANG_VENV, SETUP_NAME (log prefix).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venvs/sglang}"
REQ="$ROOT/tests/sglang/requirements-cpu.txt"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
read -ra PINS <<< "${SGLANG_PINS:-}"
NAME="${SETUP_NAME:-setup_sglang_env}"
STAMP="$VENV/.attnplug-sglang-stamp"
# pyproject.toml is in the stamp because the editable install carries its entry points.
WANT="sglang=$SGLANG_VERSION${PINS[*]:+ pins=${PINS[*]// /,}} req=$(sha256sum "$REQ" | cut -c1-16) pyproject=$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "$NAME: $VENV up to date ($WANT)"; exit 0
fi
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.14.1 triton==3.8.0  # the triton torch 2.14.1 requires, named for docs/compatibility.md
"${PIP[@]}" -r "$REQ"
[[ ${#PINS[@]} -eq 0 ]] || "${PIP[@]}" "${PINS[@]}"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"$VENV/bin/python" -c "import triton" 2>/dev/null || "${PIP[@]}" triton
"${PIP[@]}" "pytest>=8" pytest-xdist safetensors
"${PIP[@]}" --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import torch, triton, transformers; import importlib.metadata as m; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'sglang', m.version('sglang'))"
echo "$WANT" > "$STAMP"
echo "$NAME: done ($WANT)"
