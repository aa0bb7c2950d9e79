"""The e2e harness's speculation pieces on CPU (benchmarks/e2e/spec_workload.py, engine_run.py): the cycle
finder, cycle prompts, accepted tokens per step from vLLM's counters and SGLang's per-request counts, and
``engine_run`` recording them for every speculative row (a fake engine stands in for vLLM / SGLang)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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
        return [{"tokens": ([p[0] % 7 + 3, 11, 12] * n)[:n]} if i % 2 == 0 else
                {"tokens": list(range(100, 100 + n))} for i, p in enumerate(ps)]  # fmt: skip
    return generate


def test_cycle_prompts_end_in_the_models_continuation():
    calls = []
    ps, stats = sw.cycle_prompts(_cycling_generate(calls), 4, 300, seed=1, vocab_hi=1000)
    assert calls == [(4, sw.GEN_LEN)]
    assert [len(p) for p in ps] == [300] * 4
    assert stats == {"cycles": 2, "prompts": 4, "mean_period": 3.0}
    assert ps[0][-3:] in ([11, 12, ps[0][-1]], ps[0][-6:-3])  # ends repeating its cycle
    assert ps[1][-sw.GEN_LEN:] == list(range(100, 100 + sw.GEN_LEN))
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

    def generate(self, ps, n, logprobs=False):
        self.n["steps"] += len(ps) * n // 3
        self.n["accepted"] += 2 * (len(ps) * n // 3)
        return [{"tokens": [7] * n, **({"top": [[[7, 0.0]]] * n} if logprobs else {})} for _ in ps]

    def close(self):
        pass


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_engine_run_records_accepted_per_step_for_every_speculative_row(tmp_path, monkeypatch, spec):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 500}))
    monkeypatch.setattr(engine_run, "VLLM", _FakeEngine)
    monkeypatch.setattr(engine_run, "ROWS", [(2, 300, 9, 2), (3, 300, 6, 1)])
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["engine_run.py", "vllm", "X", "--model", str(tmp_path / "m"), "--out", str(out),
                                      "--spec", spec, "--prompts", "cycle", "--rows", "0,1"])  # fmt: skip
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
