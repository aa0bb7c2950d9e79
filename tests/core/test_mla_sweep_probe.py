"""benchmarks/probes/mla_sweep.py on CPU (``--smoke``: a tiny MLA decode row, the Triton interpreter): each variant
it would time is planned as asked and passes the float32 reference check; the command as typed exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from batches import interpreter_smoke_skip

pytestmark = interpreter_smoke_skip()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mla_sweep_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command as typed
    env["PYTHONPATH"] = ROOT
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "probes", "mla_sweep.py"), "--smoke", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = [x for x in res["rows"] if x["impl"] == "attnplug.triton"]
    assert res["wrong"] == 0 and res["failed"] == 0 and len(runs) == 2, res
    forced = next(x for x in runs if x["knobs"])
    assert (forced["block_n"], forced["warps"], forced["stages"]) == (16, 4, 1), forced
    assert all(x["rel_err"] <= 1e-2 and not x["nan"] for x in runs), runs


def test_mla_sweep_grid():
    """``--grid``: the defaults, then every combination of the listed knobs, as integers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "mla_sweep", os.path.join(ROOT, "benchmarks", "probes", "mla_sweep.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod.grid("block_n=32,64 num_kv_splits=8")
    assert got == [{}, dict(block_n=32, num_kv_splits=8), dict(block_n=64, num_kv_splits=8)], got
