#!/usr/bin/env bash
# Build (idempotently) .venvs/<NAME>: the core test environment (.venvs/core: torch, pytest, ...) with
# another triton on top, for the core suite / the sm90 compile check on more than one triton release.
# The venv holds only triton; a .pth file puts .venvs/core's site-packages after it on sys.path.
# Usage: scripts/setup_triton_overlay_env.sh NAME TRITON_SPEC    e.g. triton-3.8.0 'triton==3.8.0'
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1 SPEC=$2
V=.venvs/$NAME
STAMP=$V/.attnplug-triton-overlay
bash scripts/setup_core_env.sh >/dev/null
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$SPEC" ]]; then
  rm -rf "$V"
  python3 -m venv "$V"
  "$V/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$SPEC"
  echo "$SPEC" > "$STAMP"
fi
# (re)written on every run: the absolute path stays right when the checkout (and .venvs) moved
core_site=$(.venvs/core/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
own_site=$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$(cd "$core_site" && pwd)" > "$own_site/attnplug-core-env.pth"
"$V/bin/python" -c "import triton, torch; print('$NAME: triton', triton.__version__, 'torch', torch.__version__)"
