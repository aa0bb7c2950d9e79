"""benchmarks/probes/plan_cost_probe.py's CPU run: it reports every staging primitive and make_plan on both
devices it was given (here cpu twice) for each workload, with the profiles, as numbers > 0."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plan_cost_probe_runs_on_cpu(tmp_path):
    out = tmp_path / "probe.json"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "probes", "plan_cost_probe.py"),
            "--device",
            "cpu",
            "--calls",
            "20",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    prims = res["primitives_us"]
    assert {
        f"{p}_{kb}KB" for p in ("to_nonblocking", "copy_into_prealloc", "via_prealloc_pinned") for kb in (4, 36)
    } <= set(prims)
    assert sorted(res["make_plan_us"]) == sorted(f"{w}[cpu]" for w in ("decode", "extend", "verify_tree"))
    for v in [*prims.values(), *res["make_plan_us"].values()]:
        assert math.isfinite(v) and v > 0
    assert all("make_plan" in text for text in res["profiles"].values())
