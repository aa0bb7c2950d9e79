"""The interpreter's patch memo (``providers/triton_interp.py``) changes no result: the same kernels, bit for bit, with
every nested patch run and with the memo skipping them; and it does skip them."""

from __future__ import annotations

import os

import pytest
import torch
from batches import random_case
from test_sinks import draw_sinks

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention
from attnplug.core.providers import triton_interp as interp_memo

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter only")


def _run(mode, q_lens, prefix, cfg, seed, **plan_kwargs):
    c = random_case(mode, q_lens, prefix, cfg, "cpu", seed=seed)
    attn = PagedAttention(c.config, "triton", "cpu")
    attn.plan(c.batch, num_pages=c.num_pages, **plan_kwargs)
    out = torch.empty_like(c.q)
    lse = torch.empty(c.q.shape[0], cfg.num_qo_heads)
    sinks = {"sinks": draw_sinks(cfg.num_qo_heads, seed=seed)} if cfg.sinks else {}
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, **sinks)
    return out, lse


CASES = {
    "decode splits + sinks": (
        ForwardMode.DECODE,
        [1] * 3,
        [5, 70, 33],
        AttentionConfig(8, 2, 64, 16, torch.bfloat16, sinks=True),
        {"num_kv_splits": 3},
    ),
    "extend soft cap + window": (
        ForwardMode.EXTEND,
        [23, 9],
        [21, 32],
        AttentionConfig(4, 2, 32, 16, torch.bfloat16, logits_soft_cap=5.0, window_left=20),
        {},
    ),
    "verify tree": (ForwardMode.TARGET_VERIFY, [4, 4], [17, 3], AttentionConfig(4, 1, 64, 1, torch.float16), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_memo_is_exact_and_skips(name):
    assert interp_memo.install()
    mode, q_lens, prefix, cfg, knobs = CASES[name]
    interp_memo.enabled = False
    try:
        before = dict(interp_memo.stats)
        ref = _run(mode, q_lens, prefix, cfg, 3, **knobs)
        assert interp_memo.stats["skipped"] == before["skipped"]
    finally:
        interp_memo.enabled = True
    before = dict(interp_memo.stats)
    got = _run(mode, q_lens, prefix, cfg, 3, **knobs)
    assert interp_memo.stats["skipped"] > before["skipped"], "no nested patch was skipped"
    for a, b in zip(ref, got):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b)
