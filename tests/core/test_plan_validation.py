"""Bad input is refused in plan() with a ValueError naming the argument and the expected value."""

from __future__ import annotations

import re

import pytest
import torch
from batches import random_case

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, ProviderUnavailable, UnsupportedFeature
from attnplug.core.plan import make_plan

CFG = AttentionConfig(8, 2, 64, 16, torch.bfloat16)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # triton on CPU: the interpreter only


def case(mode=ForwardMode.EXTEND):
    return random_case(mode, [5, 3], [20, 0], CFG, seed=0)


def test_valid_plan_fields():
    c = case()
    p = make_plan(CFG, c.batch, num_pages=c.num_pages)
    assert p.kv_lens_cpu.tolist() == [25, 3]
    assert p.q_lens_cpu.tolist() == [5, 3]
    assert (p.num_tokens, p.max_q_len, p.max_kv_len) == (8, 5, 25)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: setattr(b, "kv_indices", b.kv_indices.long()), "kv_indices must have dtype torch.int32"),
        (lambda b: setattr(b, "qo_indptr", b.qo_indptr.float()), "qo_indptr must have dtype torch.int32"),
        (lambda b: setattr(b, "kv_indptr", b.kv_indptr[:-1]), "kv_indptr must have 3 elements"),
        (lambda b: setattr(b, "kv_last_page_len", b.kv_last_page_len.view(2, 1)), "kv_last_page_len must be 1-D"),
        (lambda b: b.kv_indices.__setitem__(0, 999), r"kv_indices must be in \[0, num_pages="),
        (lambda b: b.kv_indices.__setitem__(0, -1), r"kv_indices must be in \[0, num_pages="),
        (lambda b: b.kv_last_page_len.__setitem__(0, 17), "kv_last_page_len must be in 1..page_size=16"),
        (lambda b: b.qo_indptr.__setitem__(2, 30), r"q_len=25 exceeds kv_len=3"),
        (lambda b: b.kv_indptr.__setitem__(1, 5), "kv_indptr must be non-decreasing"),
        (lambda b: setattr(b, "mode", "extend"), "mode must be a ForwardMode"),
    ],
)
def test_bad_batch(mutate, match):
    c = case()
    mutate(c.batch)
    with pytest.raises(ValueError, match=match):
        PagedAttention(CFG, "reference", "cpu").plan(c.batch, num_pages=c.num_pages)


def test_decode_needs_single_token():
    c = case(ForwardMode.DECODE)
    with pytest.raises(ValueError, match="DECODE needs q_len == 1"):
        make_plan(CFG, c.batch, num_pages=c.num_pages)


def test_mask_of_wrong_length():
    c = random_case(ForwardMode.TARGET_VERIFY, [4, 2], [10, 3], CFG, seed=1)
    c.batch.custom_mask = c.batch.custom_mask[:-1]
    with pytest.raises(ValueError, match=r"custom_mask must have sum\(q_len\*kv_len\)=66 elements, got 65"):
        make_plan(CFG, c.batch, num_pages=c.num_pages)


def test_run_inputs_checked_at_setup():
    c = case()
    attn = PagedAttention(CFG, "reference", "cpu")
    attn.plan(c.batch, num_pages=c.num_pages)
    with pytest.raises(ValueError, match="q must have dtype torch.bfloat16"):
        attn.check_inputs(c.q.half(), c.k_cache, c.v_cache)
    with pytest.raises(ValueError, match=r"q must have shape \[num_tokens, num_qo_heads, head_dim\]=\[8, 8, 64\]"):
        attn.check_inputs(c.q[:, :4], c.k_cache, c.v_cache)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        attn.check_inputs(c.q, c.k_cache.transpose(1, 2), c.v_cache)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_qo_heads=6, num_kv_heads=4), "must be a multiple of num_kv_heads"),
        (dict(page_size=0), "page_size must be in 1..256"),
        (dict(page_size=512), "page_size must be in 1..256"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(kv_layout="NDH"), "kv_layout must be one of"),
        (dict(window_left=-5), "window_left must be -1"),
        (dict(page_size=True), "page_size must be an int, got True"),
        (dict(page_size=16.0), "page_size must be an int, got 16.0"),
        (dict(head_dim=None), "head_dim must be an int, got None"),
    ],
)
def test_bad_config(kwargs, match):
    base = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match=match):
        AttentionConfig(**{**base, **kwargs})


def test_unknown_and_unavailable_providers():
    with pytest.raises(ValueError, match="unknown provider 'nope'"):
        PagedAttention(CFG, "nope", "cpu")
    with pytest.raises(UnsupportedFeature, match="provider 'triton' does not support head_dim 512"):
        PagedAttention(AttentionConfig(8, 2, 512, 16), "triton", "cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        for name in ("flashinfer", "fa3"):
            with pytest.raises(
                ProviderUnavailable,
                match=f"provider '{name}' is unavailable: it needs a (CUDA|Hopper CUDA) GPU.*To install: .*pip install",
            ):
                PagedAttention(CFG, name, "cpu")


def test_unknown_and_foreign_plan_options():
    attn = PagedAttention(CFG, "reference", "cpu")
    c = random_case(ForwardMode.DECODE, [1, 1], [5, 9], CFG, seed=2)
    with pytest.raises(
        ValueError, match=r"attnplug: provider 'reference' has no plan option\(s\) \['num_splits'\]; it reads none"
    ):
        attn.plan(c.batch, num_pages=c.num_pages, num_splits=2)
    with pytest.raises(ValueError, match=r"provider 'reference' has no plan option\(s\) \['num_kv_splits'\]"):
        attn.plan(c.batch, num_pages=c.num_pages, num_kv_splits=2)
    triton = PagedAttention(CFG, "triton", DEV)
    c = random_case(ForwardMode.DECODE, [1, 1], [5, 9], CFG, DEV, seed=2)
    with pytest.raises(
        ValueError,
        match=r"attnplug: provider 'triton' has no plan option\(s\) \['num_splits', 'prefill_backend'\]; it reads "
        r"\['block_m', 'block_n', 'kv_start', 'num_kv_splits', 'num_stages', 'num_warps'\] \(TritonOptions\)",
    ):
        triton.plan(c.batch, num_pages=c.num_pages, prefill_backend="fa2", num_splits=2)
    p = triton.plan(c.batch, num_pages=c.num_pages, num_kv_splits=2, block_n=32)
    assert (p.options.num_kv_splits, p.options.block_n, p.options.block_m) == (2, 32, None)


def _options_types() -> dict[str, type]:
    """Each registered provider's and MLA provider's ``Options`` type, by ``name[/mla]``."""
    from attnplug.core.providers import get_provider_cls, provider_names

    out = {}
    for name in provider_names():
        cls = get_provider_cls(name)
        out[name] = cls.Options
        mla = cls.mla_class()
        if mla is not None:
            out[f"{name}/mla"] = mla.Options
    return out


def test_each_provider_options_refuse_another_providers_knob():
    """Every provider's ``Options`` refuses each knob only another provider reads, naming attnplug, the
    provider and the knobs it reads; the knob-owning providers own distinct types."""
    from attnplug.core.plan import PlanOptions
    from attnplug.core.providers.flashinfer import FlashInferOptions
    from attnplug.core.providers.triton import TritonOptions

    types = _options_types()
    assert types["triton"] is TritonOptions and types["triton/mla"] is TritonOptions
    assert types["flashinfer"] is FlashInferOptions and types["flashinfer/mla"] is PlanOptions
    assert types["reference"] is PlanOptions and types["fa3"] is PlanOptions
    all_knobs = set().union(*(t.knob_names() for t in types.values()))
    assert all_knobs == {
        "num_kv_splits",
        "block_m",
        "block_n",
        "num_warps",
        "num_stages",
        "kv_start",
        "prefill_backend",
    }
    checked = 0
    for who, opts in types.items():
        reads = sorted(opts.knob_names())
        for knob in sorted(all_knobs - opts.knob_names()):
            reads_text = re.escape(str(reads or "none"))
            msg = rf"^attnplug: provider '{who}' has no plan option\(s\) \['{knob}'\]; it reads {reads_text}"
            with pytest.raises(ValueError, match=msg):
                opts.parse({knob: 1}, who)
            checked += 1
        for knob in reads:  # its own knobs parse into its own type
            assert getattr(opts.parse({knob: 1}, who), knob) == 1
    assert checked >= 2 * 1 + 6 + 4 * 7  # triton (and its MLA), flashinfer, four knob-less types


def test_no_knobs_share_one_instance():
    """``plan()`` without knobs allocates no options: one frozen instance per type; a provider reads the
    knob-less base as its own type's, and refuses another provider's options."""
    import dataclasses

    from attnplug.core.plan import PlanOptions
    from attnplug.core.providers.flashinfer import FlashInferOptions
    from attnplug.core.providers.triton import TritonOptions

    for t in (PlanOptions, TritonOptions, FlashInferOptions):
        assert t.parse({}) is t.parse({}, "x") is t.none() and type(t.none()) is t
    assert TritonOptions.none() is not FlashInferOptions.none()
    with pytest.raises(dataclasses.FrozenInstanceError):
        TritonOptions.none().num_kv_splits = 4
    assert TritonOptions.of(PlanOptions.none()) is TritonOptions.none()
    forced = TritonOptions(num_kv_splits=3)
    assert TritonOptions.of(forced) is forced
    with pytest.raises(TypeError, match="attnplug: plan options FlashInferOptions given where TritonOptions"):
        TritonOptions.of(FlashInferOptions(prefill_backend="fa2"))
    attn = PagedAttention(CFG, "triton", DEV)
    c = random_case(ForwardMode.DECODE, [1, 1], [5, 9], CFG, DEV, seed=2)
    assert attn.plan(c.batch, num_pages=c.num_pages).options is TritonOptions.none()
    assert make_plan(CFG, c.batch, num_pages=c.num_pages).options is PlanOptions.none()


def test_pinned_options_keep_the_split_count_where_the_provider_takes_it():
    """A graph part's / draft step's pinned options: tiles and ``num_kv_splits`` for triton (its static
    split memory is sized by it); providers that take no split count drop it."""
    from attnplug.core.providers.triton import TritonOptions

    triton = PagedAttention(CFG, "triton", DEV).provider
    assert triton.takes_split_count()
    o = triton.pinned_options({"block_m": 64}, 4)
    assert type(o) is TritonOptions and (o.block_m, o.num_kv_splits) == (64, 4)
    assert triton.pinned_options({}, None) is TritonOptions.none()
    ref = PagedAttention(CFG, "reference", "cpu").provider
    assert not ref.takes_split_count()
    assert ref.pinned_options({}, 4) is ref.Options.none()
    with pytest.raises(ValueError, match="provider 'reference' has no plan option"):
        ref.pinned_options({"block_m": 64}, None)


def test_mask_free_columns():
    """Leading columns every query sees: the whole prefix for a verify tree, less for random masks."""
    c = random_case(ForwardMode.TARGET_VERIFY, [4, 3], [10, 0], CFG, seed=3)
    p = make_plan(CFG, c.batch, num_pages=c.num_pages)
    assert p.mask_free_cpu.tolist() == [10 + 1, 0 + 1]  # the tree root (first draft token) is seen by all
    c.batch.custom_mask[1] = False  # request 0, row 0, column 1
    assert make_plan(CFG, c.batch, num_pages=c.num_pages).mask_free_cpu.tolist() == [1, 1]


def test_triton_on_cpu_refuses_a_late_interpreter_switch():
    """TRITON_INTERPRET set after triton was imported leaves it compiled: refused with the reason."""
    import subprocess
    import sys

    code = (
        "import os; os.environ.pop('TRITON_INTERPRET', None); import triton.language; "
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from attnplug.core import AttentionConfig, PagedAttention\n"
        "PagedAttention(AttentionConfig(4, 2, 64, 16), 'triton', 'cpu')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "triton was imported in compiled mode" in r.stderr


def test_numpy_integers_become_ints_and_the_plan_stays_int32():
    """A numpy page size (the fuzz test found it: ``np.int64(4)``) once made ``kv_lens`` int64, a
    kernel argument every provider reads as int32: the config stores Python ints."""
    np = pytest.importorskip("numpy")
    cfg = AttentionConfig(np.int32(8), np.int64(2), np.int64(64), np.int64(4), torch.float32, window_left=np.int64(-1))
    assert all(
        type(getattr(cfg, f)) is int for f in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "window_left")
    )
    assert cfg == AttentionConfig(8, 2, 64, 4, torch.float32)
    c = random_case(ForwardMode.EXTEND, [3, 1], [5, 9], cfg, "cpu", seed=0)
    plan = make_plan(cfg, c.batch, num_pages=c.k_cache.shape[0])
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"):
        assert getattr(plan, name).dtype == torch.int32, name
