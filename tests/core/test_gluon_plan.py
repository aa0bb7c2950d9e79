"""The triton provider's choice of the Gluon prefill kernel (issue 46), decided at plan time: on a machine
that has it (``_gluon``, set from :func:`gluon_sm90` at config time; forced here, plans launch nothing) causal
16-bit page-16 prefill / extend batches at head_dim 64 / 128 / 256 plan ``gluon`` with 128-row tiles sorted
longest first; every feature it does not cover plans the Triton kernels, exactly as without Gluon. Its
compiled form is checked by ``sm90_aot.py``; what it computes, on the GPU
(``tests/gpu/test_gluon_prefill_gpu.py``).
"""

from __future__ import annotations

import torch
from batches import random_case, triton_launch

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention
from attnplug.core.kernels.gluon_prefill import CONFIGS
from attnplug.core.providers.triton import gluon_sm90

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # plans only: the GPU run plans on its device
BF = torch.bfloat16
E4M3 = torch.float8_e4m3fn
H200_SMS = 132
COVERED = {  # name -> (config, q lens, prefix lens)
    "prefill_d128": (AttentionConfig(32, 8, 128, 16, BF), [300, 17, 129], [0, 0, 0]),
    "extend_d128": (AttentionConfig(32, 8, 128, 16, BF), [200, 37, 513], [1000, 0, 77]),
    "d64": (AttentionConfig(32, 8, 64, 16, BF), [300], [0]),
    "mha": (AttentionConfig(8, 8, 128, 16, BF), [300], [0]),
}
# the GPU test's cases (tests/gpu/test_gluon_prefill_gpu.py): each fills the H200's SMs unsplit at every shape
CASES = {  # name -> (q lens, prefix lens): ragged, lengths off the tiles (128 rows) and key blocks (64 / 128)
    "prefill": ([300, 17, 129, 1000], [0, 0, 0, 0]),
    "extend": ([200, 37, 513, 1, 1500], [1000, 0, 77, 4000, 300]),
    "long": ([2100], [0]),
}
SHAPES = {  # name -> (Hq, Hkv, D)
    "d128_g4": (32, 8, 128),
    "d128_g1": (8, 8, 128),
    "d128_g8": (64, 8, 128),
    "d64_g4": (32, 8, 64),
}
FALLBACKS = {  # name -> (config, mode, q lens, prefix lens): features the Gluon kernel does not cover
    "window": (AttentionConfig(32, 8, 128, 16, BF, window_left=100), ForwardMode.EXTEND, [300], [50]),
    "soft_cap": (AttentionConfig(32, 8, 128, 16, BF, logits_soft_cap=30.0), ForwardMode.EXTEND, [300], [50]),
    "sinks": (AttentionConfig(32, 8, 64, 16, BF, sinks=True), ForwardMode.EXTEND, [300], [50]),
    "fp8_kv": (AttentionConfig(32, 8, 128, 16, BF, kv_dtype=E4M3), ForwardMode.EXTEND, [300], [50]),
    "fp32": (AttentionConfig(8, 8, 64, 16, torch.float32), ForwardMode.EXTEND, [300], [50]),
    "page_1": (AttentionConfig(32, 8, 128, 1, BF), ForwardMode.EXTEND, [300], [50]),
    "page_64": (AttentionConfig(32, 8, 128, 64, BF), ForwardMode.EXTEND, [300], [50]),
    "d96": (AttentionConfig(32, 8, 96, 16, BF), ForwardMode.EXTEND, [300], [50]),
    "d256": (AttentionConfig(16, 8, 256, 16, torch.float16, "HND"), ForwardMode.EXTEND, [300], [10]),  # no entry
    "group_3": (AttentionConfig(24, 8, 128, 16, BF), ForwardMode.EXTEND, [300], [50]),
    "tree_verify": (AttentionConfig(32, 8, 128, 16, BF), ForwardMode.TARGET_VERIFY, [64, 64], [300, 40]),
    "short_extend": (AttentionConfig(32, 8, 128, 16, BF), ForwardMode.EXTEND, [5, 9], [1000, 30]),
    "split": (AttentionConfig(32, 8, 128, 16, BF), ForwardMode.EXTEND, [200], [8000]),  # few tiles: KV splits
}


def _plan(config, mode, q_lens, prefix, gluon: bool, **knobs):
    case = random_case(mode, q_lens, prefix, config, DEV)
    attn = PagedAttention(config, "triton", DEV)
    attn.provider._sms, attn.provider._gluon = H200_SMS, gluon
    return attn.plan(case.batch, num_pages=case.num_pages, **knobs)


def test_no_gluon_on_cpu():
    """Never on CPU; on this machine's device the provider takes what :func:`gluon_sm90` finds."""
    assert not gluon_sm90(torch.device("cpu"))
    assert PagedAttention(AttentionConfig(32, 8, 128, 16, BF), "triton", DEV).provider._gluon is gluon_sm90(DEV)


def test_covered_batches_plan_gluon():
    for name, (config, q_lens, prefix) in COVERED.items():
        plan = _plan(config, ForwardMode.EXTEND, q_lens, prefix, True)
        t = triton_launch(plan)
        assert t["kernel"] == "gluon", name
        assert t["block_m"] == CONFIGS[config.head_dim][0] == t["block_q"] * config.group_size, (name, t)
        assert t["num_splits"] == 1, (name, t)
        req, q0 = plan.state.tile_req.tolist(), plan.state.tile_qstart.tolist()
        kv = plan.kv_lens_cpu.tolist()
        work = [kv[r] - q_lens[r] + s for r, s in zip(req, q0)]  # the causal keys of each tile's first row
        assert work == sorted(work), name  # ascending: the kernel runs the list backwards, longest first
        assert sum(-(-q // t["block_q"]) for q in q_lens) == t["num_tiles"], name
        # the same batch without Gluon: a Triton kernel
        without = triton_launch(_plan(config, ForwardMode.EXTEND, q_lens, prefix, False))
        assert without["kernel"] != "gluon", name


def test_gpu_cases_plan_gluon_at_every_shape():
    """What the GPU test runs takes the Gluon kernel: an extend of few tiles and long keys would plan the
    Triton kernels' KV splits instead (``FALLBACKS["split"]``)."""
    for shape, (hq, hkv, d) in SHAPES.items():
        for name, (q_lens, prefix) in CASES.items():
            plan = _plan(AttentionConfig(hq, hkv, d, 16, BF), ForwardMode.EXTEND, q_lens, prefix, True)
            assert triton_launch(plan)["kernel"] == "gluon", (shape, name, triton_launch(plan))
    few = _plan(AttentionConfig(8, 8, 128, 16, BF), ForwardMode.EXTEND, [200, 37, 513, 1], [1000, 0, 77, 4000], True)
    assert triton_launch(few)["kernel"] != "gluon" and triton_launch(few)["num_splits"] > 1


def test_uncovered_features_plan_the_triton_kernels():
    for name, (config, mode, q_lens, prefix) in FALLBACKS.items():
        with_gluon = triton_launch(_plan(config, mode, q_lens, prefix, True))
        without = triton_launch(_plan(config, mode, q_lens, prefix, False))
        assert with_gluon["kernel"] != "gluon", name
        keys = ("kernel", "block_m", "block_q", "block_n", "num_splits", "num_tiles")
        assert {k: with_gluon[k] for k in keys} == {k: without[k] for k in keys}, name


def test_forced_knobs_plan_the_triton_kernels():
    config, q_lens, prefix = COVERED["prefill_d128"]
    for knobs in (dict(block_n=32), dict(num_warps=4), dict(num_kv_splits=1), dict(block_m=64)):
        forced = triton_launch(_plan(config, ForwardMode.EXTEND, q_lens, prefix, True, **knobs))
        assert forced["kernel"] != "gluon", knobs


def test_gluon_is_on_by_default(monkeypatch):
    """On an sm90 GPU (faked here) the Gluon kernel is chosen unless ``ATTNPLUG_GLUON=0``; the version check
    runs only past the flag."""
    from attnplug.core.providers import triton as tp

    seen = []
    monkeypatch.setattr(tp, "triton_interpreter_active", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: seen.append(1) or (9, 0))
    monkeypatch.setattr(tp, "GLUON_TRITON", ((0, 0), (0, 0)))  # past the flag: the version check refuses
    monkeypatch.delenv(tp.GLUON_ENV, raising=False)
    assert tp.gluon_wanted() and not tp.gluon_sm90(torch.device("cuda")) and seen
    for off in ("0", "off"):
        monkeypatch.setenv(tp.GLUON_ENV, off)
        seen.clear()
        assert not tp.gluon_wanted() and not tp.gluon_sm90(torch.device("cuda")) and not seen
    monkeypatch.setenv(tp.GLUON_ENV, "1")
    assert tp.gluon_wanted()
