"""Python sources of a PyPI release, from its wheel, for checks that read code without importing
it (a CUDA-only engine or library on a machine without a GPU): ``pip download --no-deps`` once,
the ``.py`` files and ``METADATA`` unpacked to ``.venvs/engine-src/<dist>-<version>``
(``ATTNPLUG_ENGINE_SRC`` moves that folder), the wheel itself not kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_CACHE = os.environ.get("ATTNPLUG_ENGINE_SRC", os.path.join(ROOT, ".venvs", "engine-src"))


def wheel_sources(dist: str, version: str) -> str:
    """Folder with ``dist==version``'s Python sources (and ``METADATA``) from its PyPI wheel."""
    dest = os.path.join(SRC_CACHE, f"{dist}-{version}")
    if os.path.isfile(os.path.join(dest, ".complete")):
        return dest
    tmp = dest + ".download"
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        f"{dist}=={version}", "-d", tmp], capture_output=True, text=True, timeout=900)  # fmt: skip
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")] if os.path.isdir(tmp) else []
    assert r.returncode == 0 and wheels, f"could not download {dist}=={version}: {r.stderr[-2000:]}"
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
        z.extractall(dest, [m for m in z.namelist() if m.endswith(".py") or m.endswith("METADATA")])
    shutil.rmtree(tmp)
    open(os.path.join(dest, ".complete"), "w").close()
    return dest
