"""benchmarks/probes/ncu_probe.py on CPU (``--smoke``: the quick rows, Triton interpreter): the forward it profiles
on the GPU is the row's, planned as asked, and its output passes the float32 reference check."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from batches import interpreter_smoke_skip

pytestmark = interpreter_smoke_skip()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probe(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command as typed
    env["PYTHONPATH"] = ROOT
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "probes", "ncu_probe.py"), "--smoke", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "row,extra,cascade", [("decode 4x100 fp8", [], False), ("cascade decode 6x(64+16)", ["--cascade", "always"], True)]
)
def test_ncu_probe_smoke(row, extra, cascade):
    r = probe("--row", row, "--check", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ncu_probe: {row} provider triton cascade {cascade}" in r.stdout, r.stdout
    err = float(re.search(r"rel err ([0-9.e+-]+)", r.stdout).group(1))
    assert err <= 2e-2


def test_ncu_probe_entry_and_unknown_row():
    """``--entry`` puts a tile-table entry in force (a decode kernel entry for the quick config's rows);
    an unknown row is an error naming the rows."""
    r = probe(
        "--row",
        "decode 4x100",
        "--check",
        "--entry",
        'd64/g2/decode={"kernel": "decode", "block_n": 32, "num_warps": 4, "num_stages": 2}',
    )
    assert r.returncode == 0 and "kernel decode" in r.stdout, (r.stdout, r.stderr[-2000:])
    r = probe("--row", "no such row")
    assert r.returncode != 0 and "decode 4x100" in r.stderr
