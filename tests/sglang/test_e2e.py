"""End to end on CPU: SGLang 0.5.23 (and 0.5.17, ``scripts/setup_sglang0517_env.sh``) generating with
``--attention-backend attnplug_triton``.

The tiny Llama (real random weights, float32) generates greedily (``ignore_eos``) for ragged prompts,
two of which share a 96-token prefix so the radix cache hits. Token ids must equal HF transformers'
greedy generation of the same weights and SGLang's ``torch_native`` backend; marker files written by
our backend in the scheduler process prove which backend ran (and that it did not when unselected).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from sglang_helpers import HERE, subprocess_env

from attnplug.tools.local_server import free_port, post_json, stop_process_group, wait_healthy
from attnplug.tools.tiny_model import test_prompts as tiny_prompts

pytestmark = pytest.mark.sglang

MAX_NEW = 16
NUM_LAYERS = 2  # attnplug.tools.tiny_model


def check_layer_runs(m: dict) -> None:
    """Exact: every counted forward ran all NUM_LAYERS layers through attnplug. The marker is written
    when a forward is planned, before its layers run: the last forward's layer runs are not in it."""
    assert m["layer_runs"] == NUM_LAYERS * (sum(m["forwards"].values()) - 1), m


WAVES = [[0, 1, 3, 4], [2]]  # prompt 2 shares 96 tokens (+BOS) with prompt 1, which finishes first
SHARED = 97


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts()


@pytest.fixture(scope="module")
def hf_greedy(tiny_model, prompts):
    """HF transformers greedy continuation of every prompt (full recompute each step, float32)."""
    from attnplug.tools.tiny_model import hf_greedy as greedy

    return greedy(tiny_model, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def engine_runs(tiny_model, prompts, tmp_path_factory):
    """One subprocess, three sglang.Engine runs: torch_native, attnplug_triton page 1 and page 16."""
    tmp = tmp_path_factory.mktemp("engine")
    markers = {n: tmp / f"markers-{n}" for n in ("torch_native", "attnplug_p1", "attnplug_p16")}
    for d in markers.values():
        d.mkdir()
    runs = [
        {"name": "torch_native", "engine": {"attention_backend": "torch_native"}},
        {"name": "attnplug_p1", "engine": {"attention_backend": "attnplug_triton"}},
        {"name": "attnplug_p16", "engine": {"attention_backend": "attnplug_triton", "page_size": 16}},
    ]
    for r in runs:
        r["env"] = {"ATTNPLUG_MARKER_DIR": str(markers[r["name"]])}
    spec = {"model": str(tiny_model), "prompts": prompts, "max_new_tokens": MAX_NEW, "waves": WAVES, "runs": runs}
    (tmp / "spec.json").write_text(json.dumps(spec))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_script.py"), str(tmp / "spec.json"), str(tmp / "out.json")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=540,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (tmp / "out.json").exists(), log[-6000:]
    out = json.loads((tmp / "out.json").read_text())
    print(f"engine runs took {time.time() - t0:.0f} s")
    return out, markers, log


def _markers(d):
    return [json.loads(p.read_text()) for p in d.glob("sglang-*.json")]


def test_hf_reference_is_not_degenerate(hf_greedy):
    assert all(len(o) == MAX_NEW for o in hf_greedy)
    assert len({tuple(o) for o in hf_greedy}) == len(hf_greedy)  # distinct prompts, distinct outputs


def test_torch_native_matches_hf_and_attnplug_did_not_run(engine_runs, hf_greedy):
    """Installed but unselected: our backend never ran, output is SGLang's own (== HF)."""
    out, markers, _ = engine_runs
    r = out["torch_native"]
    assert r["ok"], r.get("error")
    assert r["output_ids"] == hf_greedy
    assert _markers(markers["torch_native"]) == []


@pytest.mark.parametrize("run, page", [("attnplug_p1", 1), ("attnplug_p16", 16)])
def test_engine_attnplug_triton_matches_torch_native_and_hf(engine_runs, hf_greedy, run, page):
    out, markers, log = engine_runs
    r = out[run]
    assert r["ok"], r.get("error")
    assert r["output_ids"] == out["torch_native"]["output_ids"] == hf_greedy
    # radix cache hit on the shared prefix (whole pages only)
    assert r["cached_tokens"][2] == SHARED // page * page > 0
    (m,) = _markers(markers[run])
    assert m["backend"] == "attnplug_triton" and m["provider"] == "triton" and m["page_size"] == page
    assert m["triton_interpret"] == "1"  # switched on by the backend itself (not in the test env)
    # per mode: one prefill forward and MAX_NEW - 1 decode forwards per wave
    assert m["forwards"] == {"EXTEND": len(WAVES), "DECODE": len(WAVES) * (MAX_NEW - 1)}, m
    check_layer_runs(m)
    assert m["max_cached_prefix"] >= SHARED // page * page


def _launch(tiny_model, backend, port, log_path, marker_dir, *extra):
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tiny_model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--skip-tokenizer-init",
        "--disable-overlap-schedule",
        "--mem-fraction-static",
        "0.3",
        "--max-total-tokens",
        "4096",
        "--attention-backend",
        backend,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--random-seed",
        "0",
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        env=subprocess_env(ATTNPLUG_MARKER_DIR=str(marker_dir)),
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_launch_server_http_generate(tiny_model, prompts, hf_greedy, tmp_path):
    port, log_path = free_port(), tmp_path / "server.log"
    proc = _launch(tiny_model, "attnplug_triton", port, log_path, tmp_path)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log_path, timeout=300)
        before = _markers(tmp_path)  # after the server's own warm-up request (if it sends one)
        sp = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        got = {}
        for wave in WAVES:
            payload = {"input_ids": [prompts[i] for i in wave], "sampling_params": sp}
            res = post_json(f"http://127.0.0.1:{port}/generate", payload, timeout=300)
            got.update(zip(wave, res))
    finally:
        stop_process_group(proc)
    log = log_path.read_text()
    assert [got[i]["output_ids"] for i in range(len(prompts))] == hf_greedy
    assert got[2]["meta_info"]["cached_tokens"] == SHARED
    assert "attnplug: attnplug_triton active (provider triton, page 1, layout NHD, dtype float32" in log
    (m,) = _markers(tmp_path)  # one process (the scheduler) ran our backend, the one selected
    assert (m["backend"], m["provider"], m["page_size"]) == ("attnplug_triton", "triton", 1), m
    before = before[0] if before else {"forwards": {}, "pid": m["pid"]}
    assert before["pid"] == m["pid"], (before, m)
    # per mode, exact: each wave (one /generate request) is one prefill forward and MAX_NEW - 1 decodes
    modes = set(m["forwards"]) | set(before["forwards"])
    delta = {k: m["forwards"].get(k, 0) - before["forwards"].get(k, 0) for k in modes}
    assert {k: n for k, n in delta.items() if n} == {"EXTEND": len(WAVES), "DECODE": len(WAVES) * (MAX_NEW - 1)}, (
        before,
        m,
    )
    check_layer_runs(m)
    assert m["max_cached_prefix"] >= SHARED


def test_attnplug_flashinfer_fails_at_startup_on_cpu(tiny_model, tmp_path):
    port, log_path = free_port(), tmp_path / "server.log"
    proc = _launch(tiny_model, "attnplug_flashinfer", port, log_path, tmp_path)
    try:
        rc = proc.wait(300)
    finally:
        stop_process_group(proc)
    log = log_path.read_text()
    assert rc != 0, log[-4000:]
    assert "attnplug: backend 'attnplug_flashinfer' cannot start on cpu: provider 'flashinfer' is unavailable" in log, (
        log[-4000:]
    )
    assert "To install:" in log and "flashinfer-python" in log
    assert _markers(tmp_path) == []


def test_demo_sglang(tmp_path):
    """``python -m attnplug.tools.demo_sglang`` (the main-job demo) serves with attnplug_triton and matches
    torch_native."""
    env = subprocess_env()
    env["PYTHONPATH"] = env["PYTHONPATH"].split(os.pathsep, 1)[1]  # no shim on the path: the demo finds it itself
    from attnplug.sglang_adapter import compat

    if compat._version_tuple(compat.sglang_version()) < (0, 5, 23):
        # SGLang 0.5.17 on CPU: its paged KV allocator (alloc_extend_kernel) is Triton-only (0.5.23 has a
        # native path), so the demo's torch_native reference run at page 16 needs the interpreter too;
        # attnplug_triton turns it on by itself (checked by the tests above)
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnplug.tools.demo_sglang",
            "--page-size",
            "16",
            "--max-new-tokens",
            "8",
            "--model-dir",
            str(tmp_path / "tiny"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "attnplug: attnplug_triton active (provider triton, page 16" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(
        "PASS sglang: attnplug_triton matches torch_native (5/5 prompts identical); active line: "
        '"attnplug: attnplug_triton active (provider triton, page 16'
    ), last
    assert "(cached prompt tokens: 96)" in r.stdout
