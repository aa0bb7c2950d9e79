#!/usr/bin/env bash
# Build (idempotently) a CPU-only SGLang 0.5.17 test environment in .venvs/sglang0517 (the SGLang
# release of the H200 image: torch 2.11 there). scripts/test.sh (suite sglang0517) runs the adapter unit
# tests in it (test_backend_unit, test_graph_and_draft, test_register); the whole suite by hand:
#   bash scripts/setup_sglang0517_env.sh
#   .venvs/sglang0517/bin/python -m pytest tests/sglang -q -p no:cacheprovider -rs
# (test_contract_sglang.py is written against 0.5.23's sources and fails on 0.5.17.)
# The recipe of scripts/setup_sglang_env.sh (torch 2.14.1 on CPU, SGLang's pure-Python deps from
# tests/sglang/requirements-cpu.txt, sglang with --no-deps, no GPU packages), then the pins where
# sglang 0.5.17 differs from 0.5.23 (transformers, xgrammar, openai, timm) and sglang==0.5.17.
# Fast path: when .venvs/sglang (0.5.23) is already built on the same file system, it is cloned
# with hard links (cp -al: no extra disk, pip only ever unlinks/replaces files, so the source venv is
# untouched) instead of downloading torch again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG0517_VENV:-$ROOT/.venvs/sglang0517}"
SRC="${SGLANG_VENV:-$ROOT/.venvs/sglang}"
if [[ ! -x "$VENV/bin/python" && -f "$SRC/.attnplug-sglang-stamp" ]]; then
  mkdir -p "$(dirname "$VENV")"
  if cp -al "$SRC" "$VENV.tmp" 2>/dev/null; then
    rm -f "$VENV.tmp/.attnplug-sglang-stamp"
    # the clone's scripts name the source venv (shebangs, activate): sed -i writes new files, so the
    # hard links to the source venv are broken, never written through
    grep -lIr --exclude=python* -- "$SRC" "$VENV.tmp/bin" 2>/dev/null | while read -r f; do
      sed -i "s#$SRC#$VENV#g" "$f"; done
    mv "$VENV.tmp" "$VENV"
    echo "setup_sglang0517_env: cloned $SRC (hard links)"
  else
    rm -rf "$VENV.tmp"
  fi
fi
# sglang 0.5.17's own pins that differ from requirements-cpu.txt (0.5.23's); torch stays 2.14.1 on CPU
SGLANG_VENV="$VENV" SGLANG_VERSION=0.5.17 SETUP_NAME=setup_sglang0517_env \
  SGLANG_PINS="transformers==5.12.1 xgrammar==0.2.1 openai==2.6.1 timm==1.0.16" \
  exec bash "$ROOT/scripts/setup_sglang_env.sh"
