"""The e2e harness's speculation pieces on CPU (benchmarks/e2e/spec_workload.py, engine_run.py): the cycle
finder, cycle prompts, accepted tokens per step from vLLM's counters and SGLang's per-request counts, and
``engine_run`` recording them for every speculative row (a fake engine stands in for vLLM / SGLang)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "e2e"))
import engine_run  # noqa: E402
import spec_workload as sw  # noqa: E402


def test_find_cycle_shortest_period_and_tail():
    assert sw.find_cycle([5, 1, 2, 3, 1, 2, 3, 1, 2, 3]) == (3, 9)
    assert sw.find_cycle([9, 8, 7, 7, 7, 7]) == (1, 4)
    assert sw.find_cycle([1, 2, 3, 4, 5, 6]) is None
    assert sw.find_cycle([4, 1, 2, 1, 2]) == (2, 4)
    assert sw.find_cycle([1, 2, 3, 1, 2], min_repeats=2) is None


def _cycling_generate(calls):
    def generate(ps, n):
        calls.append((len(ps), n))
        return [
            {"tokens": ([p[0] % 7 + 3, 11, 12] * n)[:n]} if i % 2 == 0 else {"tokens": list(range(100, 100 + n))}
            for i, p in enumerate(ps)
        ]

    return generate


def test_cycle_prompts_end_in_the_models_continuation():
    calls = []
    ps, stats = sw.cycle_prompts(_cycling_generate(calls), 4, 300, seed=1, vocab_hi=1000)
    assert calls == [(4, sw.GEN_LEN)]
    assert [len(p) for p in ps] == [300] * 4
    assert stats == {"cycles": 2, "prompts": 4, "mean_period": 3.0}
    assert ps[0][-3:] in ([11, 12, ps[0][-1]], ps[0][-6:-3])  # ends repeating its cycle
    assert ps[1][-sw.GEN_LEN :] == list(range(100, 100 + sw.GEN_LEN))
    ps2, _ = sw.cycle_prompts(_cycling_generate([]), 4, 300, seed=2, vocab_hi=1000)
    assert ps2[0][:40] != ps[0][:40], "fresh random heads (no prefix-cache hits)"
    with pytest.raises(ValueError, match="plen"):
        sw.cycle_prompts(_cycling_generate([]), 1, 100, seed=1, vocab_hi=1000)


def test_vllm_step_stats_count_every_step():
    s = sw.vllm_step_stats(256, {"steps": 10, "accepted": 20}, {"steps": 60, "accepted": 120})
    assert s["accepted_per_step"] == round(256 / (256 - 100), 3) and s["accepted_per_verify"] == 3.0
    none = sw.vllm_step_stats(256, {"steps": 0, "accepted": 0}, {"steps": 0, "accepted": 0})  # no drafts: n-gram
    assert none["accepted_per_step"] == 1.0 and "accepted_per_verify" not in none
    assert sw.vllm_step_stats(8, {}, {"steps": None, "accepted": None})["accepted_per_step"] is None
    m = sw.merge(s, none)
    assert m["tokens"] == 512 and m["accepted_per_step"] == round(512 / (512 - 100), 3)


def test_sglang_step_stats_with_and_without_verify_counts():
    outs = [{"tokens": [1] * 8, "spec_verify_ct": 2}, {"tokens": [1] * 8}]
    s = sw.sglang_step_stats(outs)
    assert s["target_steps"] == 10 and s["accepted_per_step"] == 1.6 and s["verify_steps"] == 2


class _FakeEngine:
    """vLLM-shaped: spec counters that advance with each generate (2 accepted per request step)."""

    def __init__(self, a):
        self.version, self.spec, self.n = "fake", a.spec != "none", {"steps": 0, "accepted": 0}

    def kv_capacity(self):
        return 1

    def spec_counters(self):
        return dict(self.n) if self.spec else {}

    def generate(self, ps, n, logprobs=False, samples=1):
        self.n["steps"] += len(ps) * n // 3
        self.n["accepted"] += 2 * (len(ps) * n // 3)
        self.calls = getattr(self, "calls", []) + [(len(ps), n, samples)]
        return [
            {"tokens": [7] * n, **({"top": [[[7, 0.0]]] * n} if logprobs else {})} for _ in ps for _ in range(samples)
        ]

    def close(self):
        pass


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_engine_run_records_accepted_per_step_for_every_speculative_row(tmp_path, monkeypatch, spec):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 500}))
    monkeypatch.setattr(engine_run, "VLLM", _FakeEngine)
    monkeypatch.setattr(engine_run, "ROWS", [(2, 300, 9, 2), (3, 300, 6, 1)])
    out = tmp_path / "r.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "engine_run.py",
            "vllm",
            "X",
            "--model",
            str(tmp_path / "m"),
            "--out",
            str(out),
            "--spec",
            spec,
            "--prompts",
            "cycle",
            "--rows",
            "0,1",
        ],
    )
    monkeypatch.setenv("ATTNPLUG_MARKER_DIR", str(tmp_path / "markers"))
    engine_run.main()
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"2x300->9", "3x300->6"}
    for name, r in rows.items():
        assert len(r["cycle_prompts"]) == (2 if name.startswith("2x") else 1)
        if spec == "none":
            assert "accepted_per_step" not in r
        else:
            assert r["accepted_per_step"] == 3.0 and r["spec"]["accepted_per_verify"] == 3.0


def test_engine_run_samples_row_times_every_sample_on_a_cached_prompt(tmp_path, monkeypatch):
    """``--prompts shared --samples 8`` (issue 43's parallel-sampling row): the prompt goes through the
    prefix cache first, the timed run asks 8 samples of it and counts their tokens, the row is named
    with ``n=8``, and the samples of the first prompt are kept for the token comparison."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 500}))
    engines = []
    monkeypatch.setattr(engine_run, "VLLM", lambda a: engines.append(_FakeEngine(a)) or engines[-1])
    monkeypatch.setattr(engine_run, "ROWS", [(1, 300, 9, 1)])
    monkeypatch.setattr(engine_run, "SHARED_PREFIX", 40)
    out = tmp_path / "r.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "engine_run.py",
            "vllm",
            "X",
            "--model",
            str(tmp_path / "m"),
            "--out",
            str(out),
            "--prompts",
            "shared",
            "--samples",
            "8",
            "--rows",
            "0",
        ],
    )
    monkeypatch.setenv("ATTNPLUG_MARKER_DIR", str(tmp_path / "markers"))
    engine_run.main()
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"1x300->9 n=8"} and res["samples"] == 8
    assert engines[0].calls[-3:] == [(1, 1, 1), (1, 9, 8), (1, engine_run.CORR_TOKENS, 8)]
    assert len(res["shared_correctness"]) == 8


SMALL = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "vocab_size": 50,
    "num_hidden_layers": 2,
    "architectures": ["LlamaForCausalLM"],
    "initializer_range": 0.02,
}


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle_repeat_head_proposes_the_last_token(tmp_path, engine):
    """make_model.py's draft head, run as the engines' EAGLE(-1) Llama head computes it (fc on cat(embed,
    hidden), one pre-norm decoder layer with layer 0's input norm skipped, hidden + residual, the shared
    lm_head): its logits are the target's at the hidden state it gets, so it proposes that token again."""
    import make_model

    w = {k: v.float() for k, v in make_model.eagle_repeat_weights(SMALL, engine).items()}
    assert ("fc.bias" in w) == (engine == "sglang") and ("layers.0.input_layernorm.weight" in w) == (engine == "sglang")
    g = torch.Generator().manual_seed(0)
    H = SMALL["hidden_size"]
    emb, lm_head = torch.randn(50, H, generator=g), torch.randn(50, H, generator=g)
    hidden, tokens = _rms(torch.randn(5, H, generator=g)), torch.randint(0, 50, (5,), generator=g)
    x = torch.cat([emb[tokens], hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", torch.zeros(H))
    p = "layers.0."
    q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    attn = torch.zeros(5, w[p + "self_attn.o_proj.weight"].shape[1])  # any attention of q, k, v: o_proj maps it
    attn[:, : v.shape[1]] = v + q[:, : v.shape[1]] + k
    resid = x + attn @ w[p + "self_attn.o_proj.weight"].T
    n2 = _rms(resid) * w[p + "post_attention_layernorm.weight"]
    mlp = (torch.nn.functional.silu(n2 @ w[p + "mlp.gate_proj.weight"].T) * (n2 @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"
    ].T
    out = resid + mlp
    assert torch.equal((out @ lm_head.T).argmax(-1), (hidden @ lm_head.T).argmax(-1))
    assert torch.allclose(out, hidden, atol=1e-2)


def test_eagle_draft_folders_hold_config_and_weights(tmp_path):
    """The files (safetensors: the engines' venvs; run with .venvs/vllm or .venvs/sglang)."""
    pytest.importorskip("safetensors", reason="make_model.py writes safetensors: run in an engine venv")
    import make_model
    from safetensors.torch import load_file

    make_model.write_eagle_draft(str(tmp_path), SMALL)
    for engine in ("vllm", "sglang"):
        cfg = json.loads((tmp_path / engine / "config.json").read_text())
        assert cfg["architectures"] == [make_model.EAGLE_ARCH[engine]] and cfg["num_hidden_layers"] == 1
        got = load_file(str(tmp_path / engine / "model.safetensors"))
        want = make_model.eagle_repeat_weights(SMALL, engine)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert engine_run.has_weights(str(tmp_path / engine))


def test_engine_run_loads_draft_weights_when_present(tmp_path):
    assert not engine_run.has_weights(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert engine_run.has_weights(str(tmp_path))


def test_report_counts_cascade_replays_and_flags_a_shared_run_that_cut_nothing(tmp_path, monkeypatch, capsys):
    """benchmarks/e2e/report.py: every attnplug run of a variant shows its markers' cascade forwards (eager +
    graph replays); a shared-prefix or n-sample run whose markers count none, cascade not turned off, is
    flagged, as a harness bug."""
    import report

    def run(backend, tok_s, graph_updates, env=None):
        return {
            "engine": "vllm",
            "engine_version": "x",
            "backend": backend,
            "eager": False,
            "eagle": False,
            "spec": "none",
            "tp": 1,
            "prompts": "shared",
            "env": env or {},
            "samples": 8,
            "kv_cache_dtype": "auto",
            "init_s": 1,
            "rows": {"1x256->256 n=8": {"tok_s": tok_s, "runs": [tok_s]}},
            "markers": []
            if backend == "FLASH_ATTN"
            else [{"cascade_forwards": 0, "cascade_graph_updates": graph_updates}],
        }

    res = tmp_path / "res"
    res.mkdir()
    runs = {
        "vllm-FLASH_ATTN-shared-n8": run("FLASH_ATTN", 100.0, 0),
        "vllm-ATTNPLUG_TRITON-shared-n8": run("ATTNPLUG_TRITON", 170.0, 255),
        "vllm-ATTNPLUG_TRITON-env-shared-n8": run("ATTNPLUG_TRITON", 100.0, 0, {"ATTNPLUG_CASCADE_GRAPHS": "0"}),
        "vllm-ATTNPLUG_FA3-shared-n8": run("ATTNPLUG_FA3", 160.0, 0),
    }
    for name, r in runs.items():
        (res / f"{name}.json").write_text(json.dumps(r))
    monkeypatch.setattr(
        sys,
        "argv",
        ["report.py", str(res), "--engine", "vllm", "--name", "t", "--command", "c", "--out", str(tmp_path / "out")],
    )
    report.main()
    md = (tmp_path / "out" / "t.md").read_text()
    row = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ATTNPLUG")}
    assert "8 samples of each prompt" in md
    assert (
        "cascade 0 eager + 255 graph forwards" in row["ATTNPLUG_TRITON"] and "NO CASCADE" not in row["ATTNPLUG_TRITON"]
    )
    assert "(1.700 vs FLASH_ATTN)" in row["ATTNPLUG_TRITON"]
    assert "NO CASCADE RAN" in row["ATTNPLUG_FA3"]
    off = row["ATTNPLUG_TRITON+ATTNPLUG_CASCADE_GRAPHS=0"]  # turned off on purpose: counted, not flagged
    assert "cascade 0 eager + 0 graph forwards" in off and "NO CASCADE" not in off
