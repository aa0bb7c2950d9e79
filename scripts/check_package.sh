#!/usr/bin/env bash
# The package as a user gets it: `python -m build` makes the sdist and the wheel (into $1, default a
# temporary folder), the wheel goes into a clean venv, and there `import attnplug` works, both entry
# points are listed, LICENSE / py.typed / the SPDX license / the extras are in the metadata, and the
# demos' and bench's --help run (no torch in that venv: --help must not need it; nothing from a
# checkout). The wheel is installed --no-deps: torch is the engine environment's, never ours to pick.
# Usage: scripts/check_package.sh [DIST_DIR]   (prints the wheel path last)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIST="${1:-$(mktemp -d /tmp/attnplug-dist.XXXXXX)}"
TOOLS="$ROOT/.venvs/pkg"
STAMP="$TOOLS/.attnplug-pkg-v1"
if [[ ! -f $STAMP ]]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q --disable-pip-version-check build
  touch "$STAMP"
fi
mkdir -p "$DIST" && rm -rf "$DIST"/attnplug-*
# a copy of the tracked files: the build must not depend on (or write into) the working tree
SRC="$(mktemp -d /tmp/attnplug-src.XXXXXX)"
CLEAN=
trap 'rm -rf "$SRC" ${CLEAN:+"$CLEAN"}' EXIT  # the source copy and the clean venv go, pass or fail
git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 cp --parents -t "$SRC" 2>/dev/null) || true
"$TOOLS/bin/python" -m build --outdir "$DIST" "$SRC" >"$DIST/build.log" 2>&1 || { tail -30 "$DIST/build.log"; exit 1; }
rm -rf "$SRC"
WHEEL=$(ls "$DIST"/attnplug-*.whl)
SDIST=$(ls "$DIST"/attnplug-*.tar.gz)
CLEAN="$(mktemp -d /tmp/attnplug-clean.XXXXXX)"
python3 -m venv "$CLEAN"
"$CLEAN/bin/pip" install -q --disable-pip-version-check --no-deps "$WHEEL"
cd "$CLEAN"  # not the checkout: only the installed wheel is importable
"$CLEAN/bin/python" - "$WHEEL" "$SDIST" <<'EOF'
import importlib.metadata as md, subprocess, sys, tarfile, zipfile

import attnplug

wheel, sdist = sys.argv[1], sys.argv[2]
assert attnplug.__file__.startswith(sys.prefix), f"attnplug imported from {attnplug.__file__}, not the venv"
eps = {(g, e.name, e.value) for g in ("vllm.general_plugins", "sglang.srt.plugins") for e in md.entry_points(group=g)}
assert eps == {("vllm.general_plugins", "attnplug", "attnplug.vllm_adapter:register"),
               ("sglang.srt.plugins", "attnplug", "attnplug.sglang_adapter:register")}, eps
meta = md.metadata("attnplug")
assert meta["License-Expression"] == "Apache-2.0", meta["License-Expression"]
assert not [c for c in meta.get_all("Classifier") if c.startswith("License ::")], "license classifier beside SPDX"
extras = set(meta.get_all("Provides-Extra"))
assert {"triton", "flashinfer", "bench", "test", "dev"} <= extras, extras
reqs = meta.get_all("Requires-Dist")
assert not any(r.startswith(("vllm", "sglang", "requests")) for r in reqs), reqs
assert any(r.startswith("triton") and ">=3.6" in r and 'extra == "triton"' in r for r in reqs), reqs
names = zipfile.ZipFile(wheel).namelist()
for want in ("attnplug/py.typed", "attnplug/compat/contract.py"):
    assert want in names, want
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "no LICENSE in the wheel"
assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names), "checkout files in the wheel"
src = [n for n in tarfile.open(sdist).getnames()]
assert any(n.endswith("/LICENSE") for n in src), "no LICENSE in the sdist"
for n in names:
    if n.endswith(".py"):
        text = zipfile.ZipFile(wheel).read(n).decode()
        assert "tempfile.mktemp(" not in text, f"{n}: tempfile.mktemp (racy); use mkdtemp"
for mod in ("attnplug.tools.demo", "attnplug.bench", "attnplug.tools.demo_vllm", "attnplug.tools.demo_sglang",
            "attnplug.tools.tiny_model"):
    r = subprocess.run([sys.executable, "-m", mod, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m {mod}"), (mod, r.stdout[:300], r.stderr[-800:])
print(f"package ok: attnplug {attnplug.__version__}; entry points {sorted(g for g, _, _ in eps)}; "
      f"License-Expression {meta['License-Expression']}; extras {sorted(extras)}; 5 CLIs --help without torch")
EOF
echo "$WHEEL"
