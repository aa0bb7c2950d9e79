"""The benchmark's ``--cuda-graphs`` bookkeeping (``python -m attnplug.bench``), engine-free: what cannot be
captured is refused before timing, a replay whose output is wrong keeps no time, and the ratios use only
timed library records. (The capture itself runs on the GPU: ``--cuda-graphs`` there.)"""

from __future__ import annotations

import math

import pytest
import torch

from attnplug.bench import timing
from attnplug.bench.__main__ import not_timed_if_wrong, ratios
from attnplug.core import AttentionConfig, PagedAttention
from attnplug.core.providers import flashinfer as fip


def test_not_capturable_is_refused_before_any_call():
    calls = []
    fn = lambda: calls.append(1)  # noqa: E731
    fn.not_capturable = "a wrapper built without use_cuda_graph"
    with pytest.raises(timing.NotCapturable, match="use_cuda_graph"):
        timing.graphed(fn, torch.device("cuda"))
    assert calls == []
    plain = lambda: None  # noqa: E731
    assert timing.graphed(plain, torch.device("cpu")) is plain  # CPU: timed as it is


def test_eager_run_capturable_is_the_providers_own():
    assert fip.FlashInferProvider.EAGER_RUN_CAPTURABLE is False  # eager FlashInfer wrappers replan their buffers
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # triton compiled on a GPU, interpreted on CPU
    attn = PagedAttention(AttentionConfig(4, 2, 32, 16, torch.float32), "triton", dev)
    assert attn.provider.EAGER_RUN_CAPTURABLE is True


@pytest.mark.parametrize("err, timed", [(1e-3, True), (0.9, False), (math.nan, False)])
def test_a_wrong_replay_keeps_no_time(err, timed):
    rec = dict(impl="x", ms=0.1, GBps=1.0, TFLOPs=1.0, status="ok", err_graph=err)
    not_timed_if_wrong(rec)
    assert ("ms" in rec) == timed and ("GBps" in rec) == timed
    assert rec["status"] == "ok" if timed else rec["status"].startswith("WRONG: the CUDA-graph replay")


def test_ratios_use_timed_library_records_only():
    recs = [
        dict(impl="lib.a", family="a", library=True, ms=0.2),
        dict(impl="lib.b", family="b", library=True),
        dict(impl="ours.a", family="a", library=False, ms=0.1),
        dict(impl="ours.b", family="b", library=False, ms=0.4),
    ]
    ratios(recs)
    assert recs[2]["vs_best_lib"] == pytest.approx(2.0) and recs[2]["vs_own_lib"] == pytest.approx(2.0)
    assert recs[3]["vs_best_lib"] == pytest.approx(0.5) and recs[3]["vs_own_lib"] is None  # b's library was not timed
    assert recs[0]["vs_own_lib"] is None and recs[1]["vs_best_lib"] is None


@pytest.mark.parametrize("kv", ["", "fp8"])
def test_decode_graph_twin_computes_the_row(kv):
    """``--cuda-graphs``' twin of an eager-only provider (a decode ``GraphState``, updated on the host) gives
    the float32 reference on a decode row, bf16 and fp8 (scales as the adapters pass them)."""
    from attnplug.bench import impls
    from attnplug.bench import workloads as W

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row = next(r for r in W.QUICK_ROWS if r.kind == "decode" and r.kv == kv and not r.shared)
    work = W.build(row, AttentionConfig(**W.QUICK_CONFIG), dev)
    out = impls._decode_graph_run(work, "triton")()
    ref = W.reference(work, row.batch)
    assert not out.isnan().any() and W.rel_err(out[: row.batch], ref) < 1e-2
