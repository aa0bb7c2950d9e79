"""Fuzzing of the core's input validation (issue 17 §3): ``make_plan``, ``BatchMetadata``'s
classmethods and the page-table converters with malformed input.

Every malformed input must raise ``ValueError`` naming the argument - never another exception type,
a crash or a hang (each example has a deadline) - and every accepted input must be truly valid:

* ``make_plan`` is checked against a plain-Python oracle (:func:`oracle`) that validates the batch
  element by element and computes each plan field the straightforward way (the semantics of the
  torch version the numpy fast path replaced): it must raise exactly when the oracle finds a
  violation, name one of the violated arguments, and otherwise produce the oracle's fields;
* accepted batches run through the ``reference`` and ``triton`` providers on a *poisoned* cache
  (every slot outside the batch's ``kv_len`` tokens is NaN): a read out of bounds shows up as NaN,
  and both providers must agree;
* ``PagedAttention.run`` refuses a cache with fewer pages than the plan reads.
"""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention
from attnplug.core import page_table as pt
from attnplug.core.plan import make_plan

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # triton runs compiled on a GPU, interpreted on CPU

I32 = torch.int32
I32_MAX = 2**31 - 1
ABSURD = [-1, -7, -(2**31), 2**31 - 1, 2**31 - 2, 2**30, 65536]
# a deadline per example catches a hang; generous, the CI machine is shared
FUZZ = settings(max_examples=250, deadline=timedelta(seconds=60), suppress_health_check=list(HealthCheck))
INDEX_ARGS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


# ---- valid batches ---------------------------------------------------------------------------------
@st.composite
def valid_batches(draw, max_b: int = 5, page_sizes=(1, 2, 4, 16)):
    """``(batch, page_size, num_pages)``: a valid ragged batch in any mode; pages drawn with
    repetition (shared prefixes), requests with no tokens or no queries included."""
    page = draw(st.sampled_from(page_sizes))
    b = draw(st.integers(0, max_b))
    mode = draw(
        st.sampled_from(
            [
                ForwardMode.EXTEND,
                ForwardMode.DECODE,
                ForwardMode.TARGET_VERIFY,
                ForwardMode.MIXED,
                ForwardMode.DRAFT_EXTEND,
            ]
        )
    )
    q_lens, kv_lens = [], []
    for _ in range(b):
        if mode == ForwardMode.DECODE:
            q = 1
        else:
            q = draw(st.integers(0, 6))
        kv = q + draw(st.integers(0, 40))
        q_lens.append(q)
        kv_lens.append(kv)
    npg = [-(-k // page) for k in kv_lens]
    num_pages = sum(npg) + draw(st.integers(1, 4))
    ids = [draw(st.integers(0, num_pages - 1)) for _ in range(sum(npg))]
    mask = None
    causal = True
    if mode == ForwardMode.TARGET_VERIFY:
        if draw(st.booleans()):
            bits = draw(
                st.lists(
                    st.booleans(),
                    min_size=sum(q * k for q, k in zip(q_lens, kv_lens)),
                    max_size=sum(q * k for q, k in zip(q_lens, kv_lens)),
                )
            )
            mask = torch.tensor(bits, dtype=torch.bool)
            if draw(st.booleans()):
                mask = mask.to(torch.uint8) * draw(st.sampled_from([1, 3, 255]))
                mask = mask.to(torch.uint8)
            causal = draw(st.booleans())  # ignored with a mask
    batch = BatchMetadata(
        mode,
        torch.tensor(np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]), dtype=I32),
        torch.tensor(np.concatenate([[0], np.cumsum(npg, dtype=np.int64)]), dtype=I32),
        torch.tensor(ids, dtype=I32),
        torch.tensor([(k - 1) % page + 1 if k else 0 for k in kv_lens], dtype=I32),
        custom_mask=mask,
        causal=causal,
    )
    if draw(st.booleans()):  # strided (non-contiguous) views of the same values
        for name in INDEX_ARGS:
            t = getattr(batch, name)
            setattr(batch, name, torch.stack([t, torch.full_like(t, -99)], 1)[:, 0])
    return batch, page, num_pages


# ---- the oracle --------------------------------------------------------------------------------------
def oracle(batch: BatchMetadata, page: int, num_pages) -> tuple[set[str], dict]:
    """``(violated argument names, expected plan fields)``: element by element, plain Python."""
    bad: set[str] = set()
    if not isinstance(batch.mode, ForwardMode):
        bad.add("mode")
    if not isinstance(batch.causal, (bool, np.bool_)):
        bad.add("causal")
    if num_pages is not None and (
        isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 0
    ):
        bad.add("num_pages")
        num_pages = None
    vals = {}
    for name in INDEX_ARGS:  # types first, then lengths: make_plan checks each tensor's type and length together
        t = getattr(batch, name)
        if not isinstance(t, torch.Tensor) or t.dtype != I32 or t.dim() != 1 or t.device.type == "meta":
            bad.add(name)
        elif name == "kv_indices" and t.shape[0] * page > I32_MAX:
            bad.add(name)  # more tokens than int32 counts hold (checked before reading a value)
        else:
            vals[name] = t.tolist()
    qo, kvp, idx, last = (vals.get(n) for n in INDEX_ARGS)
    if qo is not None and not qo:
        bad.add("qo_indptr")
    if qo:
        B = len(qo) - 1
        if kvp is not None and len(kvp) != B + 1:
            bad.add("kv_indptr")
        if last is not None and len(last) != B:
            bad.add("kv_last_page_len")
    if bad:
        return bad, {}
    if qo[0] != 0 or any(b < a for a, b in zip(qo, qo[1:])):
        bad.add("qo_indptr")
    if kvp[0] != 0 or any(b < a for a, b in zip(kvp, kvp[1:])) or kvp[-1] != len(idx):
        bad.add("kv_indptr")
    if bad:
        return bad, {}
    npg = [b - a for a, b in zip(kvp, kvp[1:])]
    for n, l in zip(npg, last):
        if (n > 0 and not 1 <= l <= page) or (n == 0 and l != 0):
            bad.add("kv_last_page_len")
    if any(i < 0 or (num_pages is not None and i >= num_pages) for i in idx):
        bad.add("kv_indices")
    if bad:
        return bad, {}
    q_lens = [b - a for a, b in zip(qo, qo[1:])]
    kv_lens = [(n - 1) * page + l if n else 0 for n, l in zip(npg, last)]
    if any(q > k for q, k in zip(q_lens, kv_lens)):
        return {"qo_indptr"}, {}
    if batch.mode == ForwardMode.DECODE and any(q != 1 for q in q_lens):
        return {"qo_indptr"}, {}
    fields = dict(
        batch_size=B,
        num_tokens=qo[-1],
        max_q_len=max(q_lens, default=0),
        max_kv_len=max(kv_lens, default=0),
        q_lens=q_lens,
        kv_lens=kv_lens,
        max_page_id=max(idx, default=-1),
        kv_indices=idx,
    )
    cm = batch.custom_mask
    if cm is not None:
        if (
            not isinstance(cm, torch.Tensor)
            or cm.dtype not in (torch.bool, torch.uint8)
            or cm.dim() != 1
            or cm.device.type == "meta"
        ):
            return {"custom_mask"}, {}
        sizes = [q * k for q, k in zip(q_lens, kv_lens)]
        if cm.shape[0] != sum(sizes):
            return {"custom_mask"}, {}
        bits = [bool(x) for x in cm.tolist()]
        free, off = [], 0
        for q, k in zip(q_lens, kv_lens):  # the old definition: cumprod of the all-rows-visible columns
            rows = [bits[off + r * k : off + (r + 1) * k] for r in range(q)]
            c = 0
            while q and c < k and all(row[c] for row in rows):
                c += 1
            free.append(c if q else 0)
            off += q * k
        fields.update(
            mask_indptr=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist(), mask_free=free, causal=False
        )
    else:
        if batch.mode == ForwardMode.TARGET_VERIFY and not batch.causal:
            return {"causal", "custom_mask"}, {}
        fields["causal"] = bool(batch.causal)
    return set(), fields


def check_against_oracle(cfg: AttentionConfig, batch: BatchMetadata, num_pages):
    """make_plan raises a ValueError naming a violated argument exactly when the oracle finds one,
    and otherwise agrees with it field by field. Returns the plan (or None)."""
    bad, want = oracle(batch, cfg.page_size, num_pages)
    try:
        plan = make_plan(cfg, batch, num_pages=num_pages)
    except ValueError as e:
        assert bad, f"make_plan refused a valid batch: {e}"
        assert any(name in str(e) for name in bad), f"message names none of {sorted(bad)}: {e}"
        return None
    assert not bad, f"make_plan accepted a batch with bad {sorted(bad)}"
    got = dict(
        batch_size=plan.batch_size,
        num_tokens=plan.num_tokens,
        max_q_len=plan.max_q_len,
        max_kv_len=plan.max_kv_len,
        q_lens=plan.q_lens_cpu.tolist(),
        kv_lens=plan.kv_lens_cpu.tolist(),
        max_page_id=plan.max_page_id,
        kv_indices=plan.kv_indices_cpu.tolist(),
        causal=plan.causal,
    )
    if plan.mask is not None:
        got.update(mask_indptr=plan.mask_indptr_cpu.tolist(), mask_free=plan.mask_free_cpu.tolist())
        assert plan.mask.dtype == torch.uint8 and plan.mask.is_contiguous()
    assert got == want
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"):  # kernel arguments
        t = getattr(plan, name)
        assert t.dtype == I32 and t.is_contiguous(), name
    assert plan.q_lens_cpu.dtype == plan.kv_lens_cpu.dtype == I32
    return plan


# ---- mutations ---------------------------------------------------------------------------------------
def _replace(t: torch.Tensor, kind: str, value: int, where: int) -> object:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.dim() == 0 or t.numel() > 2**20:
        return t  # (the huge stride-0 kv_indices stays as it is: copying it is what the test avoids)
    if kind == "value" and t.numel():
        t = t.clone()
        try:
            t.view(-1)[where % t.numel()] = value
        except RuntimeError:  # does not fit this (already mutated) dtype
            pass
        return t
    if kind == "dtype":
        return t.to([torch.int64, torch.int16, torch.float32, torch.bool, torch.uint8][where % 5])
    if kind == "shape":
        return [t.view(1, -1), t[:-1], torch.cat([t, t[:1]]), t.sum().to(I32), t.view(-1, 1)][where % 5]
    if kind == "type":
        return [t.tolist(), t.numpy(), None, 3.5][where % 4]
    if kind == "meta":
        return t.to("meta")
    if kind == "swap" and t.numel() > 2:
        t = t.clone()  # contiguous: two neighbouring elements of its flat view swapped (any shape a round made)
        f, i = t.view(-1), 1 + where % (t.numel() - 2)
        f[i], f[i + 1] = f[i + 1].clone(), f[i].clone()
        return t
    return t


@st.composite
def mutated_batches(draw):
    batch, page, num_pages = draw(valid_batches())
    for _ in range(draw(st.integers(1, 2))):
        target = draw(st.sampled_from(INDEX_ARGS + ("custom_mask", "mode", "causal", "num_pages", "expand")))
        kind = draw(st.sampled_from(["value", "value", "dtype", "shape", "type", "meta", "swap"]))
        value = draw(st.one_of(st.sampled_from(ABSURD), st.integers(-3, 60)))
        where = draw(st.integers(0, 1000))
        if target in INDEX_ARGS:
            setattr(batch, target, _replace(getattr(batch, target), kind, value, where))
        elif target == "custom_mask":
            m = batch.custom_mask if isinstance(batch.custom_mask, torch.Tensor) else torch.zeros(3, dtype=torch.bool)
            if kind != "value":
                batch.custom_mask = _replace(m, kind, value, where)
            elif m.dim():  # a truncated mask (a mask made 0-dim by the first round stays as it is)
                batch.custom_mask = m[: where % (m.numel() + 2)]
        elif target == "mode":
            batch.mode = draw(st.sampled_from(["extend", None, 3, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]))
        elif target == "causal":
            batch.causal = draw(st.sampled_from(["yes", None, 1, False, np.bool_(True)]))
        elif target == "num_pages":
            n = num_pages if isinstance(num_pages, int) else 1
            num_pages = draw(st.sampled_from([None, -1, 0, 1, 1.5, True, 2**40, np.int64(n), n - 1]))
        else:  # a huge stride-0 kv_indices: one request of n pages of page 0
            n = draw(st.sampled_from([2**16, 2**27 + 1]))  # valid, and (page 16) past int32 tokens, never copied
            page = 16
            batch.kv_indices = torch.zeros(1, dtype=I32).expand(n)
            batch.qo_indptr = torch.tensor([0, 1], dtype=I32)
            batch.kv_indptr = torch.tensor([0, n], dtype=I32)
            batch.kv_last_page_len = torch.tensor([page], dtype=I32)
            batch.custom_mask, batch.mode = None, ForwardMode.EXTEND
            num_pages = draw(st.sampled_from([None, 1]))
    return batch, page, num_pages


def cfg_for(page: int) -> AttentionConfig:
    return AttentionConfig(2, 1, 16, page, torch.float32)


@FUZZ
@given(valid_batches())
def test_valid_batches_match_the_oracle(case):
    batch, page, num_pages = case
    assert check_against_oracle(cfg_for(page), batch, num_pages) is not None


@FUZZ
@given(mutated_batches())
def test_malformed_batches_raise_value_error_naming_the_argument(case):
    batch, page, num_pages = case
    check_against_oracle(cfg_for(page), batch, num_pages)


@pytest.mark.parametrize("device", ["meta", "cpu:7x", "nope", 3.5])
def test_bad_plan_device(device):
    batch, page, n = valid_batches().example() if False else (None, None, None)  # noqa: F841
    b = BatchMetadata(
        ForwardMode.EXTEND, *(torch.zeros(1, dtype=I32),) * 2, torch.zeros(0, dtype=I32), torch.zeros(0, dtype=I32)
    )
    with pytest.raises(ValueError, match="device"):
        make_plan(cfg_for(16), b, num_pages=4, device=device)


def test_not_a_batch():
    with pytest.raises(ValueError, match="batch must be a BatchMetadata"):
        make_plan(cfg_for(16), {"qo_indptr": torch.zeros(1, dtype=I32)})


def test_empty_batch_plans_and_runs():
    cfg = cfg_for(16)
    z = torch.zeros(1, dtype=I32)
    b = BatchMetadata(ForwardMode.DECODE, z, z, torch.zeros(0, dtype=I32), torch.zeros(0, dtype=I32))
    for provider in ("reference", "triton"):
        attn = PagedAttention(cfg, provider, DEV)
        p = attn.plan(b, num_pages=0)
        assert (p.batch_size, p.num_tokens, p.max_page_id) == (0, 0, -1)
        cache = torch.zeros(cfg.kv_cache_shape(0), device=DEV)
        assert attn.run(torch.zeros(0, 2, 16, device=DEV), cache, cache).shape == (0, 2, 16)


def test_wrapped_int32_indptr_is_refused():
    """Differences of int32 values can wrap to non-negative numbers: [0, 2**31-1, -2**31+5, -5, 10]
    has all-positive wrapped steps and ends at len(kv_indices)."""
    kvp = torch.tensor([0, 2**31 - 1, -(2**31) + 5, -5, 10], dtype=I32)
    b = BatchMetadata(
        ForwardMode.EXTEND, torch.zeros(5, dtype=I32), kvp, torch.zeros(10, dtype=I32), torch.ones(4, dtype=I32)
    )
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        make_plan(cfg_for(16), b, num_pages=1)


# ---- poisoned-cache runs -----------------------------------------------------------------------------
def poisoned_cache(cfg: AttentionConfig, plan, num_pages: int, seed: int) -> torch.Tensor:
    """Random K or V cache in which every slot outside the plan's requests' tokens is NaN."""
    g = torch.Generator().manual_seed(seed)
    P = cfg.page_size
    cache = torch.full(cfg.kv_cache_shape(num_pages), math.nan)
    tok = cache.view(num_pages * P, cfg.num_kv_heads, cfg.head_dim)  # NHD: slot = page * P + offset
    kvp, idx, kv = plan.kv_indptr_cpu.tolist(), plan.kv_indices_cpu.tolist(), plan.kv_lens_cpu.tolist()
    for b in range(plan.batch_size):
        for t in range(kv[b]):
            s = idx[kvp[b] + t // P] * P + t % P
            if math.isnan(tok[s, 0, 0]):
                tok[s] = torch.randn(cfg.num_kv_heads, cfg.head_dim, generator=g)
    return cache


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(valid_batches(max_b=4, page_sizes=(1, 4, 16)), st.integers(0, 2**16))
def test_accepted_batches_read_only_their_own_tokens(case, seed):
    """Reference and triton on a NaN-poisoned cache: finite outputs, equal to each other."""
    batch, page, num_pages = case
    cfg = cfg_for(page)
    plan = check_against_oracle(cfg, batch, num_pages)
    assume(plan is not None and plan.num_tokens > 0)
    k, v = poisoned_cache(cfg, plan, num_pages, seed), poisoned_cache(cfg, plan, num_pages, seed + 1)
    q = torch.randn(plan.num_tokens, cfg.num_qo_heads, cfg.head_dim, generator=torch.Generator().manual_seed(seed))
    outs = {}
    for provider in ("reference", "triton"):
        attn = PagedAttention(cfg, provider, DEV)
        attn.plan(batch, num_pages=num_pages)
        lse = torch.empty(plan.num_tokens, cfg.num_qo_heads, device=DEV)
        outs[provider] = (attn.run(q.to(DEV), k.to(DEV), v.to(DEV), lse=lse).cpu(), lse.cpu())
    (ro, rl), (to, tl) = outs["reference"], outs["triton"]
    assert torch.isfinite(ro).all() and torch.isfinite(to).all(), "a NaN slot outside the batch was read"
    torch.testing.assert_close(to, ro, atol=2e-4, rtol=2e-4)
    seen = torch.isfinite(rl)  # rows that see no key: lse -inf in both
    assert torch.equal(seen, torch.isfinite(tl))
    torch.testing.assert_close(tl[seen], rl[seen], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_run_refuses_tensors_smaller_than_the_plan(provider):
    cfg = cfg_for(4)
    b = BatchMetadata(
        ForwardMode.EXTEND,
        torch.tensor([0, 3], dtype=I32),
        torch.tensor([0, 2], dtype=I32),
        torch.tensor([1, 5], dtype=I32),
        torch.tensor([2], dtype=I32),
    )
    attn = PagedAttention(cfg, provider, DEV)
    attn.plan(b)  # num_pages unknown here: run() checks the cache it gets
    q = torch.randn(3, 2, 16, device=DEV)
    full = torch.randn(cfg.kv_cache_shape(6), device=DEV)
    attn.run(q, full, full)
    with pytest.raises(ValueError, match="k_cache has 5 pages but the plan's kv_indices reach page 5"):
        attn.run(q, full[:5], full)
    with pytest.raises(ValueError, match="v_cache has 5 pages"):
        attn.run(q, full, full[:5])
    with pytest.raises(ValueError, match="q must have >= num_tokens=3 rows"):
        attn.run(q[:2], full, full)
    with pytest.raises(ValueError, match="out must have >= num_tokens=3 rows"):
        attn.run(q, full, full, out=torch.empty(2, 2, 16, device=DEV))


# ---- BatchMetadata classmethods and the page-table converters ---------------------------------------
def _call(fn, names, *args, **kw):
    """``fn(*args, **kw)``: a result, or a ValueError naming one of ``names`` (anything else fails)."""
    try:
        return fn(*args, **kw)
    except ValueError as e:
        assert any(n in str(e) for n in names), f"{fn.__name__}: message names none of {names}: {e}"
        return None


def _int_tensor(draw, n_lo=0, n_hi=6, lo=-3, hi=40, dtype=I32):
    vals = draw(st.lists(st.one_of(st.integers(lo, hi), st.sampled_from(ABSURD)), min_size=n_lo, max_size=n_hi))
    return torch.tensor(vals, dtype=torch.int64).to(dtype)


@st.composite
def any_arg(draw, good):
    """``good`` (a valid argument) most of the time, else a malformed variant of it."""
    if draw(st.integers(0, 3)) or not isinstance(good, torch.Tensor):
        return good
    kind = draw(st.sampled_from(["value", "dtype", "shape", "type", "meta"]))
    return _replace(good, kind, draw(st.sampled_from(ABSURD)), draw(st.integers(0, 1000)))


PAGE_ARGS = st.one_of(st.sampled_from([1, 4, 16]), st.sampled_from([0, -1, True, 2.0, 2**40, np.int64(4), None]))


@st.composite
def block_table_args(draw):
    B = draw(st.integers(0, 4))
    W = draw(st.integers(0, 4))
    bt = torch.tensor(draw(st.lists(st.integers(-2, 30), min_size=B * W, max_size=B * W)), dtype=I32).view(B, W)
    seq = _int_tensor(draw, B, B, -2, 70)
    return bt, seq


@FUZZ
@given(block_table_args(), PAGE_ARGS, st.data())
def test_from_block_table_and_converters(args, page, data):
    bt, seq = (data.draw(any_arg(a)) for a in args)
    B = bt.shape[0] if isinstance(bt, torch.Tensor) and bt.dim() == 2 else 0
    qo = data.draw(any_arg(torch.arange(B + 1, dtype=I32)))
    names = ("block_table", "seq_lens", "page_size", "qo_indptr", "mode", "max_pages")
    b = _call(BatchMetadata.from_block_table, names, ForwardMode.EXTEND, qo, bt, seq, page)
    if b is not None:  # accepted: a consistent CSR the plan validates (values of qo_indptr included)
        n = int(b.kv_indices.max()) + 1 if b.kv_indices.numel() else 0
        assume(isinstance(page, int) and 1 <= page <= 256)
        plan = check_against_oracle(AttentionConfig(2, 1, 16, page, torch.float32), b, n)
        if plan is not None:
            assert plan.kv_lens_cpu.tolist() == seq.tolist()
            back = _call(
                pt.block_table_from_csr,
                names,
                b.kv_indptr,
                b.kv_indices,
                b.kv_last_page_len,
                page,
                data.draw(st.one_of(st.none(), st.sampled_from([-1, 0, 2, 100, 2.5, True]))),
            )
            if back is not None:
                assert back[1].tolist() == seq.tolist()
    _call(
        pt.slot_mapping,
        ("block_table", "positions", "req_ids", "page_size"),
        bt,
        data.draw(any_arg(_int_tensor(data.draw, 0, 5, -1, 80))),
        data.draw(any_arg(_int_tensor(data.draw, 0, 5, -1, 5))),
        page,
    )


@st.composite
def req_to_token_args(draw):
    S = draw(st.integers(0, 4))
    C = draw(st.integers(0, 40))
    page = draw(st.sampled_from([1, 4, 16]))
    r2t = torch.randperm(64 * page)[: S * C].to(I32).view(S, C) if S * C <= 64 * page else torch.zeros(S, C, dtype=I32)
    if draw(st.booleans()):  # page aligned rows (the valid case)
        for s in range(S):
            pages = torch.randperm(64)[: -(-C // page)]
            r2t[s] = (pages.repeat_interleave(page)[:C] * page + torch.arange(C) % page).to(I32)
    B = draw(st.integers(0, 4))
    rows = _int_tensor(draw, B, B, -1, S + 1, dtype=torch.int64)
    seq = _int_tensor(draw, B, B, -1, C + 2, dtype=draw(st.sampled_from([I32, torch.int64])))
    return r2t, rows, seq, page


@FUZZ
@given(req_to_token_args(), st.data())
def test_from_req_to_token_and_converters(args, data):
    r2t, rows, seq, page = (data.draw(any_arg(a)) for a in args)
    if data.draw(st.integers(0, 5)) == 0:
        page = data.draw(PAGE_ARGS)
    B = rows.shape[0] if isinstance(rows, torch.Tensor) and rows.dim() == 1 else 0
    qo = data.draw(any_arg(torch.arange(B + 1, dtype=I32)))
    names = ("req_to_token", "req_pool_indices", "seq_lens", "page_size", "qo_indptr", "mode")
    b = _call(BatchMetadata.from_req_to_token, names, ForwardMode.EXTEND, qo, r2t, rows, seq, page)
    if b is not None:
        plan = check_against_oracle(AttentionConfig(2, 1, 16, page, torch.float32), b, None)
        if plan is not None:
            assert plan.kv_lens_cpu.tolist() == seq.tolist()
            back = _call(
                pt.req_to_token_from_csr,
                names + ("num_req_slots", "max_ctx"),
                b.kv_indptr,
                b.kv_indices,
                b.kv_last_page_len,
                page,
                data.draw(st.sampled_from([None, -1, 0, 8, 2**40])),
                data.draw(st.sampled_from([None, -1, 0, 64, 1.5])),
            )
            if back is not None:
                assert back[2].tolist() == seq.tolist()


@st.composite
def csr_args(draw):
    batch, page, _ = draw(valid_batches(max_b=4))
    args = [
        data
        for data in (batch.kv_indptr.contiguous(), batch.kv_indices.contiguous(), batch.kv_last_page_len.contiguous())
    ]
    return [draw(any_arg(a)) for a in args], page


@FUZZ
@given(csr_args(), st.data())
def test_csr_converters(args, data):
    (kvp, idx, last), page = args
    if data.draw(st.integers(0, 5)) == 0:
        page = data.draw(PAGE_ARGS)
    csr = ("kv_indptr", "kv_indices", "kv_last_page_len", "page_size")
    _call(pt.seq_lens_from_csr, csr, kvp, last, page)
    _call(pt.block_table_from_csr, csr + ("max_pages",), kvp, idx, last, page)
    _call(pt.req_to_token_from_csr, csr + ("num_req_slots", "max_ctx"), kvp, idx, last, page)
    T = data.draw(st.integers(0, 5))
    req = data.draw(any_arg(_int_tensor(data.draw, T, T, -1, 5, dtype=torch.int64)))
    pos = data.draw(any_arg(_int_tensor(data.draw, T, T, -1, 80)))
    _call(pt.slot_mapping_from_csr, csr + ("req_ids", "positions"), kvp, idx, page, req, pos)


def test_converter_overflow_and_absurd_sizes():
    """int32 lengths next to 2**31 and absurd widths: ValueError naming the argument, no wrap."""
    # ceil(I32_MAX / 16) = 2**27 pages: with int32 math (I32_MAX + 15) wrapped negative and passed
    with pytest.raises(
        ValueError, match=r"seq_lens need up to 134217728 pages but block_table has max_pages=134217727"
    ):
        pt.csr_from_block_table(
            torch.zeros(1, 1, dtype=I32).expand(1, 2**27 - 1), torch.tensor([I32_MAX], dtype=I32), 16
        )
    big = torch.tensor([0, 2**27], dtype=I32)
    with pytest.raises(ValueError, match="kv_indptr"):
        pt.seq_lens_from_csr(big, torch.tensor([16], dtype=I32), 16)
    with pytest.raises(ValueError, match="page_size"):
        pt.seq_lens_from_csr(torch.zeros(1, dtype=I32), torch.zeros(0, dtype=I32), 2**40)
    ok = pt.seq_lens_from_csr(torch.tensor([0, 1], dtype=I32), torch.tensor([3], dtype=I32), np.int64(4))
    assert ok.tolist() == [3]
