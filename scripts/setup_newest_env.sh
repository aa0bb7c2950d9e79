#!/usr/bin/env bash
# Build .venvs/newest: what `pip install 'attnplug[test,bench]'` resolves today in a fresh environment,
# with nothing pinned: the newest torch (a CUDA build from PyPI, several GB) and the newest triton
# that torch and attnplug's [triton] range admit. The core suite runs on it (scripts/test.sh newest).
# This machine's pip configuration caps torch at the release it keeps on disk (/etc/xdg/pip); users'
# machines have no such cap, so the configuration files are left out (PIP_CONFIG_FILE=/dev/null).
# An existing venv is brought up to pip's resolution of today (-U --upgrade-strategy eager). Prints
# the torch and triton it resolved; in the suite, tests/core/test_compatibility_table.py checks that
# docs/compatibility.md lists both as CPU CI rows.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venvs/newest
export PIP_CONFIG_FILE=/dev/null
[[ -x $V/bin/python ]] || python3 -m venv "$V"
"$V/bin/pip" install -q --disable-pip-version-check -U --upgrade-strategy eager -e '.[test,bench]'
"$V/bin/python" -c "import torch, triton; print('newest: torch', torch.__version__, 'triton', triton.__version__)"
