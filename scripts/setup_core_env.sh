#!/usr/bin/env bash
# Build (idempotently) .venvs/core: the engine-free environment of the core tests and the demo.
# torch 2.13.0 CPU (this machine's local wheel), triton >= 3.7 (its interpreter runs the kernels
# on CPU), and attnplug installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venvs/core
STAMP=$V/.attnplug-core-v1
if [[ ! -f $STAMP ]]; then
  python3 -m venv "$V"
  "$V/bin/pip" install -q torch==2.13.0 triton==3.7.1 numpy pytest hypothesis matplotlib tqdm
  touch "$STAMP"
fi
"$V/bin/python" -c "import xdist" 2>/dev/null || "$V/bin/pip" install -q pytest-xdist  # scripts/test.sh runs -n 2
"$V/bin/pip" install -q --no-deps -e . >/dev/null
