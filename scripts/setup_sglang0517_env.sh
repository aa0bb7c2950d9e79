#!/usr/bin/env bash
# Build (idempotently) a CPU-only SGLang 0.5.17 test environment in .venvs/sglang0517 (the SGLang
# release of the H200 image: torch 2.11 there). NOT part of scripts/test.sh (CI time); run by hand:
#   bash scripts/setup_sglang0517_env.sh
#   .venvs/sglang0517/bin/python -m pytest tests/sglang -q -p no:cacheprovider -rs
# Same recipe as scripts/setup_sglang_env.sh (torch 2.14.1 on CPU, SGLang's pure-Python deps from
# tests/sglang/requirements-cpu.txt, sglang with --no-deps, no GPU packages), then the pins where
# sglang 0.5.17 differs from 0.5.23 (transformers, xgrammar, openai, timm) and sglang==0.5.17.
# Fast path: when .venvs/sglang (0.5.23) is already built on the same file system, it is cloned
# with hard links (cp -al: no extra disk, pip only ever unlinks/replaces files, so the source venv is
# untouched) instead of downloading torch again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG0517_VENV:-$ROOT/.venvs/sglang0517}"
SRC="${SGLANG_VENV:-$ROOT/.venvs/sglang}"
REQ="$ROOT/tests/sglang/requirements-cpu.txt"
SGLANG_VERSION=0.5.17
# sglang 0.5.17's own pins that differ from requirements-cpu.txt (0.5.23's); torch stays 2.14.1 on CPU
PINS=(transformers==5.12.1 xgrammar==0.2.1 openai==2.6.1 timm==1.0.16)
STAMP="$VENV/.attnplug-sglang-stamp"
WANT="sglang=$SGLANG_VERSION pins=${PINS[*]// /,} req=$(sha256sum "$REQ" | cut -c1-16) pyproject=$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "setup_sglang0517_env: $VENV up to date ($WANT)"; exit 0
fi
PIP=("$VENV/bin/python" -m pip install -q)
if [[ ! -x "$VENV/bin/python" ]]; then
  mkdir -p "$(dirname "$VENV")"
  if [[ -f "$SRC/.attnplug-sglang-stamp" ]] && cp -al "$SRC" "$VENV.tmp" 2>/dev/null; then
    rm -f "$VENV.tmp/.attnplug-sglang-stamp"
    # the clone's scripts name the source venv (shebangs, activate): sed -i writes new files, so the
    # hard links to the source venv are broken, never written through
    grep -lIr --exclude=python* -- "$SRC" "$VENV.tmp/bin" 2>/dev/null | while read -r f; do
      sed -i "s#$SRC#$VENV#g" "$f"; done
    mv "$VENV.tmp" "$VENV"
    echo "setup_sglang0517_env: cloned $SRC (hard links)"
  else
    rm -rf "$VENV.tmp"
    python3 -m venv "$VENV"
    "${PIP[@]}" torch==2.14.1
    "${PIP[@]}" -r "$REQ"
  fi
fi
"${PIP[@]}" "${PINS[@]}"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"$VENV/bin/python" -c "import triton" 2>/dev/null || "${PIP[@]}" triton
"${PIP[@]}" "pytest>=8" safetensors
"${PIP[@]}" --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import torch, triton, transformers; import importlib.metadata as m; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'sglang', m.version('sglang'))"
echo "$WANT" > "$STAMP"
echo "setup_sglang0517_env: done ($WANT)"
