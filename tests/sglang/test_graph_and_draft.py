"""Issue 6 (SGLang): CUDA-graph metadata, the EAGLE multi-step draft backend, its DraftBackendFactory hook.

SGLang cannot run EAGLE or CUDA graphs on CPU, so these are backend-level tests on SGLang's real
pools with hand-built ForwardBatch-like objects: a "capture" is ``init_forward_metadata_out_graph(fb,
in_capture=True)`` + the layer forward (what SGLang records), a "replay" is the out-of-graph update +
the same captured plan launched again. Oracles: our eager path, a float64 dense computation, and
SGLang's own ``generate_draft_decode_kv_indices`` (run by the Triton interpreter).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang_helpers import HKV, HQ, D, Requests, dense_reference, make_layer, make_runner

import attnplug.sglang_adapter as adapter
from attnplug.core import UnsupportedFeature
from attnplug.core.cuda_graph import FILL_SEQ_LEN
from attnplug.sglang_adapter import compat
from attnplug.sglang_adapter.backend import AttnplugAttnBackend

pytestmark = pytest.mark.sglang

TOL = dict(atol=2e-5, rtol=2e-5)


def make_backend(runner, provider="triton", name="attnplug_triton"):
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        return AttnplugAttnBackend(runner, backend_name=name, provider=provider)


def make_draft(runner, topk, steps, provider="triton"):
    from attnplug.sglang_adapter.draft import AttnplugMultiStepDraftBackend

    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        return AttnplugMultiStepDraftBackend(runner, topk, steps, provider=provider)


def rand(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- CUDA graphs: the main backend --------------------------------------------------------------------
def _verify_spec(reqs, n, seed=3):
    g = torch.Generator().manual_seed(seed)
    masks = []
    for kv in reqs.kv_lens:
        tree = torch.tril(torch.rand(n, n, generator=g) < 0.6) | torch.eye(n, dtype=torch.bool)
        tree[:, 0] = True
        masks.append(torch.cat([torch.ones(n, kv - n, dtype=torch.bool), tree], 1))
    flat = torch.cat([m.reshape(-1) for m in masks] + [torch.ones(5, dtype=torch.bool)])
    return masks, SimpleNamespace(custom_mask=flat, draft_token_num=n, num_tokens_per_req=-1, kv_indptr=None)


def _padded(fb, bs, q):
    """SGLang's graph view of ``fb``: ``bs`` requests, the last ``bs - B`` padding (row 0, seq_len =
    the fill value, writes to slot 0), ``num_padding`` set."""
    B = fb.batch_size
    pad = bs - B
    fill = torch.full((pad,), FILL_SEQ_LEN, dtype=torch.int64)
    return SimpleNamespace(
        **{
            **vars(fb),
            **dict(
                batch_size=bs,
                num_padding=pad,
                req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
                seq_lens=torch.cat([fb.seq_lens, fill]),
                seq_lens_cpu=torch.cat([fb.seq_lens_cpu, fill]),
                out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad * q, dtype=torch.int64)]),
            ),
        }
    )


def _qkv(T, seed):
    return rand((T, HQ * D), seed), rand((T, HKV, D), seed + 1), rand((T, HKV, D), seed + 2)


def _batch(runner, mode, n, kv_lens, seed):
    reqs = Requests(runner, kv_lens=kv_lens, prefix=[k - (n if mode == "verify" else 1) for k in kv_lens], seed=seed)
    if mode == "verify":
        masks, spec = _verify_spec(reqs, n, seed)
        return reqs, masks, reqs.batch(ForwardMode.TARGET_VERIFY, q_lens=[n] * len(kv_lens), spec_info=spec)
    return reqs, None, reqs.batch(ForwardMode.DECODE, q_lens=[1] * len(kv_lens))


def _fa3_standin(monkeypatch):
    """The fa3 provider on CPU: FA3's logic with the tests' stand-in kernel (tests/core/fa3_standin.py),
    float32 configs allowed (the stand-in computes any dtype)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
    import fa3_standin

    from attnplug.core.providers.fa3 import FA3Provider

    fa3_standin.patch_fa3(monkeypatch)
    monkeypatch.setattr(FA3Provider, "check_kv_dtype", lambda self, config: None)
    monkeypatch.setattr(FA3Provider, "check_config", lambda self, config: None)


@pytest.mark.parametrize(
    "mode, page_size, provider",
    [
        ("decode", 16, "triton"),
        ("decode", 1, "triton"),
        ("verify", 4, "triton"),
        ("verify", 4, "fa3"),
        ("decode", 4, "fa3"),
    ],
)
def test_graph_capture_then_replay_matches_eager(mode, page_size, provider, monkeypatch):
    """Capture then replay through the backend's graph hooks; ``fa3`` (stand-in kernel): its tree verify
    (EAGLE topk > 1: FA3 on the prefix, the tree part by attnplug's kernel, LSE-merged) is captured too."""
    from attnplug.core.cuda_graph import GraphState

    if provider == "fa3":
        _fa3_standin(monkeypatch)

    # the one-launch replay path (decode; verify with SGLang's tree masks where the provider refreshes on
    # the device) vs GraphState.update (a host-planning provider's verify)
    launches = []
    one_launch = GraphState.update_from_block_table
    monkeypatch.setattr(
        GraphState, "update_from_block_table", lambda gs, *a, **k: launches.append(1) or one_launch(gs, *a, **k)
    )
    n = 3 if mode == "verify" else 1
    bs, max_bs = 4, 4
    runner = make_runner(page_size)
    # SGLang pads with req_pool_indices 0, a row that may belong to a live request: padded slots must
    # come from the fill values, never from that row
    runner.req_to_token_pool.req_to_token[0, :64] = 3 * page_size + torch.arange(64, dtype=torch.int32)
    layer = make_layer(0)
    be = make_backend(runner, provider, f"attnplug_{provider}")
    be.init_cuda_graph_state(max_bs=max_bs, max_num_tokens=max_bs * n)

    for step, kv_lens in enumerate([[21 + n, 35 + n], [9 + n, 40 + n, 17 + n]]):  # capture, then replay
        reqs, masks, fb = _batch(runner, mode, n, kv_lens, seed=10 + step)
        B = fb.batch_size
        q, k, v = _qkv(bs * n, seed=step)
        eager = make_backend(runner, provider, f"attnplug_{provider}")
        eager.init_forward_metadata(fb)
        if step == 1:
            gs = be._graphs[mode][be.layer_config(layer)]  # the state the layer's captured plan lives in
            ptrs = {
                name: getattr(gs, name).data_ptr()
                for name in (
                    "kv_indptr",
                    "kv_indices",
                    "kv_last_page_len",
                    "kv_lens",
                    "mask",
                    "mask_indptr",
                    "mask_free",
                )
                if getattr(gs, name) is not None
            }
        be.init_forward_metadata_out_graph(_padded(fb, bs, n), in_capture=step == 0)
        if step == 1:  # replay: the captured plan's buffers, refreshed in place
            assert ptrs == {name: getattr(gs, name).data_ptr() for name in ptrs}
            assert set(gs.plans) == {bs}
        out = be.forward(q, k, v, layer, _padded(fb, bs, n))
        ref = eager.forward(q[: B * n], k[: B * n], v[: B * n], layer, fb)
        torch.testing.assert_close(out[: B * n], ref, **TOL)
        dense = dense_reference(runner, reqs, layer, q[: B * n], [n] * B, masks=masks)
        torch.testing.assert_close(out[: B * n], dense, **TOL)
        # capture-time / replay metadata over the padded batch: eager's on the real rows, fill after
        gs = be._graphs[mode][be.layer_config(layer)]
        plan, eb = gs.plans[bs], eager._batch
        nnz = int(eb.kv_indices.numel())
        assert torch.equal(plan.kv_indptr[: B + 1].cpu(), eb.kv_indptr.to(torch.int32))
        assert torch.equal(plan.kv_indices[:nnz].cpu(), eb.kv_indices.to(torch.int32))
        assert torch.equal(plan.kv_last_page_len[:B].cpu(), eb.kv_last_page_len.to(torch.int32))
        pad = bs - B
        assert torch.equal(
            gs.kv_lens[B:bs], torch.full((pad,), FILL_SEQ_LEN + (n if mode == "verify" else 0), dtype=torch.int32)
        )
        assert torch.equal(gs.kv_last_page_len[B:bs], torch.full((pad,), gs.pad_last, dtype=torch.int32))
        assert torch.equal(
            gs.kv_indices[nnz : nnz + pad * gs.pad_pages], torch.zeros(pad * gs.pad_pages, dtype=torch.int32)
        )
        if mode == "verify":
            m = int(sum(n * kv for kv in reqs.kv_lens))
            assert torch.equal(gs.mask[:m].bool(), fb.spec_info.custom_mask[:m])
            assert bool(gs.mask[m : m + pad * n * gs.pad_kv_len].all())
    assert be._stats.forwards.get("GRAPH_" + fb.forward_mode.name) == 2
    family = be._graphs[mode]
    assert family and len(launches) == (len(family) if mode == "decode" or not family.host_lengths else 0)


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_graph_cascade_replay_matches_dense_and_is_counted(mode, monkeypatch, tmp_path):
    """ATTNPLUG_CASCADE_GRAPHS=1: a decode or TARGET_VERIFY (tree masks) replay whose requests share their
    first pages in ``req_to_token`` (as SGLang's radix cache maps them) cuts them on the device, equals
    the float64 dense reference, and the scheduler's marker counts it (``cascade_graph_updates``, tokens
    cut)."""
    import json

    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "1")
    monkeypatch.setenv("ATTNPLUG_CASCADE", "always")
    monkeypatch.setenv("ATTNPLUG_MARKER_DIR", str(tmp_path))
    P, bs, n = 4, 4, (3 if mode == "verify" else 1)
    runner = make_runner(P)
    layer = make_layer(0)
    be = make_backend(runner)
    be.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * n)
    for step, kv_lens in enumerate([[21, 30], [22, 30, 26]]):  # capture, then a replay sharing 4 pages
        reqs, masks, fb = _batch(runner, mode, n, [x + n - 1 for x in kv_lens], seed=20 + step)
        if step == 1:
            tab = runner.req_to_token_pool.req_to_token
            tab[reqs.rows[1:], : 4 * P] = tab[reqs.rows[0], : 4 * P]
        q, k, v = _qkv(bs * n, seed=step)
        B = fb.batch_size
        be.init_forward_metadata_out_graph(_padded(fb, bs, n), in_capture=step == 0)
        out = be.forward(q, k, v, layer, _padded(fb, bs, n))
        dense = dense_reference(runner, reqs, layer, q[: B * n], [n] * B, masks=masks)
        torch.testing.assert_close(out[: B * n], dense, **TOL)
    gs = be._graphs[mode][be.layer_config(layer)]
    assert int(gs.cascade.kv_lens.sum()) == 4 * P, "the replay cut the 4 shared pages"
    st = be._stats
    assert (st.cascade_graph_updates, st.cascade_graph_shared_tokens) == (1, 4 * P)
    (marker,) = tmp_path.glob("sglang-*.json")
    m = json.loads(marker.read_text())
    assert (m["cascade_graph_updates"], m["cascade_graph_shared_tokens"]) == (1, 4 * P), m


def _toy_provider():
    """``tests/toy_provider.py`` registered: a provider that re-plans on the host (as FlashInfer)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import toy_provider

    toy_provider.register()
    return toy_provider


def test_host_planning_provider_decode_replay_passes_host_lengths(monkeypatch):
    """A provider that re-plans on the host (FlashInfer; here the toy provider, one file + one registry
    line, no adapter edit): decode replays go through the one launch with ``seq_lens_cpu`` of the real
    rows for its host plan, and give the dense reference; without ``seq_lens_cpu`` the host path."""
    from attnplug.core.cuda_graph import GraphState

    toy = _toy_provider()
    calls = []
    one_launch = GraphState.update_from_block_table
    monkeypatch.setattr(
        GraphState, "update_from_block_table", lambda gs, *a, **k: calls.append(k) or one_launch(gs, *a, **k)
    )
    runner, layer, bs = make_runner(16), make_layer(0), 4
    be = make_backend(runner, provider=toy.TOY)
    be.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    for step, kv_lens in enumerate([[21, 35], [9, 40, 17]]):
        reqs, _, fb = _batch(runner, "decode", 1, kv_lens, seed=20 + step)
        be.init_forward_metadata_out_graph(_padded(fb, bs, 1), in_capture=step == 0)
        q, k, v = _qkv(bs, seed=step)
        out = be.forward(q, k, v, layer, _padded(fb, bs, 1))
        torch.testing.assert_close(
            out[: fb.batch_size], dense_reference(runner, reqs, layer, q[: fb.batch_size], [1] * fb.batch_size), **TOL
        )
    states = list(be._graphs["decode"].values())  # one per layer config
    assert len(calls) == len(states) >= 1  # the replay (one launch per layer config), not the capture
    assert all(
        torch.equal(c["host_seq_lens"], fb.seq_lens_cpu) and c["host_seq_lens"].device.type == "cpu" for c in calls
    )
    assert all(gs.graph.refreshes[-1] == (bs, True) for gs in states)
    calls.clear()
    fb_no_host = _padded(fb, bs, 1)
    fb_no_host.seq_lens_cpu = None  # no host lengths: the host path (GraphState.update)
    be.init_forward_metadata_out_graph(fb_no_host)
    assert calls == [] and all(gs.graph.refreshes[-1] == (bs, False) for gs in states)


def test_fill_value_is_the_core_constant():
    be = make_backend(make_runner(1), provider="reference")
    assert be.get_cuda_graph_seq_len_fill_value() == FILL_SEQ_LEN == 1


def test_graph_refusals():
    runner = make_runner(1)
    with pytest.raises(
        UnsupportedFeature, match="attnplug_triton.*CUDA graphs with provider 'reference'.*--disable-cuda-graph"
    ):
        make_backend(runner, provider="reference").init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    reqs = Requests(runner, kv_lens=[6], prefix=[5])
    be = make_backend(runner)
    with pytest.raises(UnsupportedFeature, match="attnplug_triton.*capture without init_cuda_graph_state"):
        be.init_forward_metadata_out_graph(reqs.batch(ForwardMode.DECODE, q_lens=[1]), in_capture=True)
    be.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    with pytest.raises(UnsupportedFeature, match="attnplug_triton.*CUDA-graph this forward mode \\(EXTEND\\)"):
        be.init_forward_metadata_out_graph(reqs.batch(ForwardMode.EXTEND, q_lens=[1]), in_capture=True)
    be = make_backend(runner)
    be.init_cuda_graph_state(max_bs=2, max_num_tokens=2 * 3)  # verify graphs of 3 draft tokens
    _, _, fb = _batch(runner, "verify", 4, [12], seed=1)
    with pytest.raises(
        UnsupportedFeature, match="attnplug_triton.*TARGET_VERIFY graph batch of 4 draft tokens.*sized for 3"
    ):
        be.init_forward_metadata_out_graph(fb, in_capture=True)


# -- multi-step draft --------------------------------------------------------------------------------------
def _draft_batch(runner, topk, steps, seq, seed=0):
    page_size = runner.page_size
    cols = compat.draft_token_columns(torch.tensor(seq), topk, steps, page_size, steps)
    kv_lens = [int(cols[b].max()) + 1 for b in range(len(seq))]
    reqs = Requests(runner, kv_lens=kv_lens, prefix=seq, seed=seed)
    B = len(seq)
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        batch_size=B,
        req_pool_indices=reqs.rows.clone(),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        seq_lens_sum=sum(seq),
        positions=torch.tensor(seq).repeat_interleave(topk),
        kv_loc_plan=None,
        kv_loc_cols=None,
        spec_info=SimpleNamespace(kv_indptr=None, kv_indices=None),
        out_cache_loc=None,
        encoder_lens=None,
        out_cache_loc_is_physical=False,
    )
    r2t = runner.req_to_token_pool.req_to_token
    draft_slots = torch.stack([r2t[reqs.rows[b]][cols[b]] for b in range(B)]).long()  # [B, topk, steps]
    return reqs, fb, draft_slots


def _draft_setup(page_size, topk, steps, seq, seed=0):
    runner = make_runner(page_size, is_draft_worker=True)
    return (runner,) + _draft_batch(runner, topk, steps, seq, seed)


def _dense_step(runner, reqs, layer, draft_slots, step, q, sinks=None):
    """float64: row b*topk+j attends prefix of b + draft tokens 0..step of branch j (``sinks [Hq]``:
    one more logit per head in the denominator)."""
    kb, vb = (runner.token_to_kv_pool.get_key_buffer(0), runner.token_to_kv_pool.get_value_buffer(0))
    r2t = runner.req_to_token_pool.req_to_token
    B, K, _ = draft_slots.shape
    outs = []
    for b in range(B):
        pre = r2t[reqs.rows[b], : reqs.prefix[b]].long()
        for j in range(K):
            slots = torch.cat([pre, draft_slots[b, j, : step + 1]])
            kk = kb[slots].double().repeat_interleave(HQ // HKV, 1)
            vv = vb[slots].double().repeat_interleave(HQ // HKV, 1)
            qq = q[b * K + j].view(HQ, D).double()
            s = torch.einsum("hd,khd->hk", qq, kk) * layer.scaling
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], -1)
            p = torch.softmax(s, -1)[:, : len(slots)]
            outs.append(torch.einsum("hk,khd->hd", p, vv).reshape(HQ * D))
    return torch.stack(outs).float()


def _run_draft_steps(be, fb, draft_slots, layer, seed, rows=None, **kwargs):
    """Every attention step through ``attn_backends[i]``, writing step i's draft KV first (``kwargs``:
    the layer's forward arguments, e.g. ``sinks``)."""
    B, K, _ = draft_slots.shape
    R = rows or B * K
    outs = []
    for i, child in enumerate(be.attn_backends):
        loc = torch.zeros(R, dtype=torch.int64)
        loc[: B * K] = draft_slots[:, :, i].reshape(-1)
        q, k, v = _qkv(R, seed + 10 * i)
        sfb = SimpleNamespace(**{**vars(fb), "out_cache_loc": loc})
        outs.append((q, child.forward(q, k, v, layer, sfb, **kwargs)))
    return outs


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("page_size, topk, steps", [(1, 2, 3), (4, 3, 3), (4, 1, 4)])
def test_multistep_draft_matches_dense(provider, page_size, topk, steps):
    runner, reqs, fb, draft_slots = _draft_setup(page_size, topk, steps, seq=[7, 13])
    be = make_draft(runner, topk, steps, provider=provider)
    assert len(be.attn_backends) == steps - 1
    be.init_forward_metadata(fb)
    layer = make_layer(0)
    for i, (q, out) in enumerate(_run_draft_steps(be, fb, draft_slots, layer, seed=1)):
        torch.testing.assert_close(out, _dense_step(runner, reqs, layer, draft_slots, i, q), **TOL)
    # without the draft tokens the answer differs (the draft KV is really read)
    assert not torch.allclose(out, _dense_step(runner, reqs, layer, draft_slots[:, :, :0], -1, q), **TOL)


@pytest.mark.parametrize("page_size, topk, steps", [(1, 2, 3), (4, 3, 3), (4, 1, 4)])
def test_draft_kv_indices_equal_sglang_generate_draft_decode_kv_indices(page_size, topk, steps):
    """Our per-step token slots == what SGLang's own kernel builds (Triton interpreter on CPU)."""
    from sglang.srt.speculative.spec_utils import generate_draft_decode_kv_indices
    from sglang.srt.utils import next_power_of_2

    seq = [7, 13, 5]
    runner, reqs, fb, _ = _draft_setup(page_size, topk, steps, seq=seq)
    B, R = len(seq), len(seq) * topk
    width = B * topk * 512
    kv_indices = torch.full((steps, width), -1, dtype=torch.int64)
    kv_indptr = torch.zeros((steps, R + 1), dtype=torch.int32)
    r2t = runner.req_to_token_pool.req_to_token
    args = [
        fb.req_pool_indices,
        r2t,
        fb.seq_lens,
        kv_indices,
        kv_indptr,
        fb.positions,
        r2t.shape[1],
        width,
        R + 1,
        next_power_of_2(B),
        next_power_of_2(steps),
        next_power_of_2(R),
        page_size,
    ]
    if "window_size" in generate_draft_decode_kv_indices.arg_names:  # 0.5.23 (draft window); not in 0.5.17
        args += [0, 0]
    generate_draft_decode_kv_indices[(steps, B, topk)](*args)
    be = make_draft(runner, topk, steps, provider="reference")
    be.init_forward_metadata(fb)
    planner = be._plan(be.attn_backends[0].probe_config)
    for i, plan in enumerate(planner.plans):
        ind = kv_indptr[i]
        assert torch.equal(plan.kv_indptr_cpu, ind), i
        assert torch.equal(plan.kv_indices_cpu.long(), kv_indices[i, : int(ind[-1])]), i


def test_multistep_draft_graph_capture_and_replay():
    topk, steps, bs = 2, 3, 3
    runner = make_runner(4, is_draft_worker=True)
    layer = make_layer(0)
    be = make_draft(runner, topk, steps, provider="triton")
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * topk)
    ptrs, gss = None, []  # the states captured in round 0
    for rnd, seq in enumerate([[7, 13], [10, 3]]):  # capture, then replay of another batch (in-place update)
        reqs, fb, draft_slots = _draft_batch(runner, topk, steps, seq, seed=rnd)
        fill = torch.full((bs - 2,), FILL_SEQ_LEN, dtype=torch.int64)
        pfb = SimpleNamespace(
            **{
                **vars(fb),
                **dict(
                    batch_size=bs,
                    num_padding=bs - 2,
                    seq_lens=torch.cat([fb.seq_lens, fill]),
                    req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(1, dtype=torch.int64)]),
                    seq_lens_cpu=torch.cat([fb.seq_lens_cpu, fill]),
                ),
            }
        )
        be.init_forward_metadata_out_graph(pfb, in_capture=rnd == 0)
        if rnd:
            assert ptrs == [(gs.kv_indptr.data_ptr(), gs.kv_indices.data_ptr(), gs.kv_lens.data_ptr()) for gs in gss]
        outs = _run_draft_steps(be, pfb, draft_slots, layer, seed=5 + rnd, rows=bs * topk)
        gss = [g[be.attn_backends[0].layer_config(layer)] for g in be._graphs]
        ptrs = [(gs.kv_indptr.data_ptr(), gs.kv_indices.data_ptr(), gs.kv_lens.data_ptr()) for gs in gss]
        for i, (q, out) in enumerate(outs):
            torch.testing.assert_close(
                out[: 2 * topk], _dense_step(runner, reqs, layer, draft_slots, i, q[: 2 * topk]), **TOL
            )
            gs = gss[i]
            assert list(gs.plans) == [bs * topk]
            assert torch.equal(gs.kv_lens[2 * topk : bs * topk], torch.full((topk,), FILL_SEQ_LEN, dtype=torch.int32))
            assert torch.equal(gs.kv_lens[: 2 * topk], (torch.tensor(seq) + i + 1).repeat_interleave(topk).int())


# -- DraftBackendFactory hook and version guard ------------------------------------------------------------
def _factory(runner, name, topk=2, steps=3):
    """SGLang's DraftBackendFactory with the draft backend ``name`` selected (0.5.23: the runner's
    ``draft_attention_backend``; 0.5.17: ``server_args.speculative_draft_attention_backend``)."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    f = DraftBackendFactory.__new__(DraftBackendFactory)
    f.draft_model_runner, f.topk, f.speculative_num_steps = runner, topk, steps
    f.seed_dsa_topk_from_draft_extend, f.qsa_profile, f.draft_attn_backend = False, None, name
    f.server_args = SimpleNamespace(
        speculative_draft_attention_backend=name,
        attention_backend=None,
        prefill_attention_backend=None,
        decode_attention_backend=None,
    )
    return f


def _draft_runner():
    r = make_runner(1, is_draft_worker=True)
    r.model_config.hf_config = r.model_config.hf_text_config = None
    return r


@pytest.fixture
def hooked_factory(monkeypatch):
    """SGLang's DraftBackendFactory with our AROUND hook applied by SGLang's own wrapper."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.speculative import draft_utils

    monkeypatch.setattr(draft_utils, "attention_backends", lambda: (None, None), raising=False)  # 0.5.23 only
    orig = draft_utils.DraftBackendFactory._create_backend
    monkeypatch.setattr(
        draft_utils.DraftBackendFactory,
        "_create_backend",
        _wrap_fn(orig, adapter._around_create_backend, HookType.AROUND),
    )
    return draft_utils


def test_factory_hook_builds_our_backends(hooked_factory):
    from attnplug.sglang_adapter.draft import AttnplugMultiStepDraftBackend

    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        dec = _factory(_draft_runner(), "attnplug_triton").create_decode_backend()
        ext = _factory(_draft_runner(), "attnplug_triton")._create_backend(
            "prefill_attention_backend", {}, "EAGLE is not supported in attention backend {backend_type}"
        )
    assert type(dec) is AttnplugMultiStepDraftBackend and len(dec.attn_backends) == 2
    assert dec.decode_attention_backend_str == "attnplug_triton"
    assert all(
        c.prefill_attention_backend_str == c.decode_attention_backend_str == "attnplug_triton"
        for c in dec.attn_backends
    )
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from attnplug.sglang_adapter.draft import AttnplugDraftExtendBackend

    assert type(ext) is AttnplugDraftExtendBackend and ext.backend_name == "attnplug_triton"
    assert isinstance(ext, FlashInferAttnBackend)  # SGLang's draft-extend capture check: passed
    ext.init_cuda_graph_state(max_bs=2, max_num_tokens=8)  # draft extend graphs of W = 4
    assert set(ext._graphs) == {"draft_extend"}
    # draft extend with speculative_attention_mode == "decode": SGLang passes the decode name but no
    # stamps_children; it must get the single-step backend, not the multi-step container
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        ext2 = _factory(_draft_runner(), "attnplug_triton")._create_backend(
            "decode_attention_backend", {}, "EAGLE is not supported in attention backend {backend_type}"
        )
    assert type(ext2) is AttnplugDraftExtendBackend


def test_factory_hook_leaves_builtins_untouched(hooked_factory):
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    sentinel = SimpleNamespace(attn_backends=[])
    f = _factory(_draft_runner(), "triton")
    template = "EAGLE is not supported in decode attention backend {backend_type}"
    if compat.draft_factory_stamps(DraftBackendFactory._create_backend):  # 0.5.23: (stamp, backend), SGLang stamps
        got = f._create_backend(
            "decode_attention_backend", {"triton": lambda: ("triton", sentinel)}, template, stamps_children=True
        )
        assert got is sentinel and sentinel.decode_attention_backend_str == "triton"
    else:  # 0.5.17: the entry's backend as it is, nothing stamped
        got = f._create_backend("decode_attention_backend", {"triton": lambda: sentinel}, template)
        assert got is sentinel and not hasattr(sentinel, "decode_attention_backend_str")
    with pytest.raises(ValueError, match="^EAGLE is not supported in decode attention backend flashinfer_x$"):
        _factory(_draft_runner(), "flashinfer_x").create_decode_backend()


@pytest.fixture
def fresh_registry(monkeypatch):
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    choices = compat._choices_module()
    lst = []  # 0.5.17 has no draft choices list: stays empty
    if compat.draft_attention_backend_choices() is not None:
        lst = list(choices.DRAFT_ATTENTION_BACKEND_CHOICES)
        monkeypatch.setattr(choices, "DRAFT_ATTENTION_BACKEND_CHOICES", lst)
        monkeypatch.setattr(choices, "add_draft_attention_backend_choices", lst.extend)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(compat, "_HOOKED", set())
    return lst, HookRegistry


def test_register_installs_the_draft_hook_in_range(fresh_registry):
    lst, reg = fresh_registry
    adapter.register()
    adapter.register()
    hooks = reg._hooks[compat.DRAFT_FACTORY_TARGET]
    assert [(t.name, h) for t, h, _ in hooks] == [("AROUND", adapter._around_create_backend)]
    has_list = compat.draft_attention_backend_choices() is not None  # 0.5.23
    assert all(lst.count(n) == (1 if has_list else 0) for n in adapter.BACKENDS)


@pytest.mark.parametrize("version", ["0.5.16", "0.5.24", "0.6.0"])
def test_version_guard_outside_range(fresh_registry, monkeypatch, version):
    lst, reg = fresh_registry
    monkeypatch.setattr(compat, "sglang_version", lambda: version)
    adapter.register()
    assert compat.DRAFT_FACTORY_TARGET not in reg._hooks
    assert not any(n in lst for n in adapter.BACKENDS)
    msg = (
        rf"attnplug: EAGLE .* needs SGLang 0\.5\.17\.\.0\.5\.23 .*installed SGLang is {re_escape(version)}"
        r".*--speculative-draft-attention-backend triton"
    )
    with pytest.raises(UnsupportedFeature, match=msg):
        make_draft(make_runner(1, is_draft_worker=True), 2, 3)
    with pytest.raises(UnsupportedFeature, match=msg + r" \(backend 'attnplug_triton' on the draft model\)"):
        make_backend(make_runner(1, is_draft_worker=True))


def re_escape(s):
    import re

    return re.escape(s)


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.5.17", True),
        ("0.5.23", True),
        ("0.5.20.post1", True),
        ("0.5.23+cu128", True),
        ("0.5.16", False),
        ("0.5.24", False),
    ],
)
def test_version_range_bounds(version, ok):
    assert (compat.draft_hook_refusal(version) is None) == ok


# -- the installed SGLang's graph-runner call protocol (0.5.17 and 0.5.23) -------------------------------
class _FB(SimpleNamespace):
    """ForwardBatch stand-in: fields a runner reads but the test does not set are None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _sglang_replay_view(fb, buffers, bs, raw_bs, q, fill, mode):
    """SGLang's own ``build_replay_fb_view`` (DecodeCudaGraphRunner replay), called with the argument
    list of the installed release (0.5.23 added ``global_num_tokens_cpu``)."""
    import inspect

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

    kw = dict(
        forward_batch=fb,
        buffers=buffers,
        bs=bs,
        raw_bs=raw_bs,
        num_tokens=bs * q,
        seq_len_fill_value=fill,
        capture_forward_mode=mode,
        is_encoder_decoder=False,
    )
    if "global_num_tokens_cpu" in inspect.signature(build_replay_fb_view).parameters:
        kw["global_num_tokens_cpu"] = None
    return build_replay_fb_view(**kw)


@pytest.mark.parametrize("mode, page_size", [("decode", 16), ("verify", 4)])
def test_decode_graph_runner_protocol(mode, page_size):
    """What SGLang's DecodeCudaGraphRunner does, in its order and with its arguments:
    ``init_cuda_graph_state(max_bs, max_bs * width)``, ``get_cuda_graph_seq_len_fill_value()``; capture:
    a batch of ``bs`` fill-value rows on pool row 0 (no ``num_padding``),
    ``init_forward_metadata_out_graph(fb, in_capture=True)`` then ``init_forward_metadata_in_graph(fb)``
    and the forward; replay: its ``build_replay_fb_view`` over the padded buffers (``num_padding`` set,
    ``spec_info`` / ``out_cache_loc`` of the real batch) and ``init_forward_metadata_out_graph(view)``."""
    n = 3 if mode == "verify" else 1
    sg_mode = ForwardMode.TARGET_VERIFY if mode == "verify" else ForwardMode.DECODE
    max_bs, bs = 4, 4
    runner = make_runner(page_size)
    runner.req_to_token_pool.req_to_token[0, :64] = 3 * page_size + torch.arange(64, dtype=torch.int32)
    layer = make_layer(0)
    be = make_backend(runner)
    be.init_cuda_graph_state(max_bs, max_bs * n)
    fill = be.get_cuda_graph_seq_len_fill_value()
    buffers = SimpleNamespace(  # DecodeInputBuffers as capture leaves them
        input_ids=torch.zeros(max_bs * n, dtype=torch.int64),
        positions=torch.zeros(max_bs * n, dtype=torch.int64),
        req_pool_indices=torch.zeros(max_bs, dtype=torch.int64),
        seq_lens=torch.full((max_bs,), fill),
        seq_lens_cpu=torch.full((max_bs,), fill),
        encoder_lens=None,
        mamba_track_indices=None,
        custom_mask=torch.ones(max_bs * n * 600, dtype=torch.bool),
        out_cache_loc=torch.zeros(max_bs * n, dtype=torch.int64),
    )
    cap_spec = (
        SimpleNamespace(custom_mask=buffers.custom_mask, draft_token_num=n, num_tokens_per_req=n, kv_indptr=None)
        if mode == "verify"
        else None
    )
    cap = _FB(
        forward_mode=sg_mode,
        batch_size=bs,
        req_pool_indices=buffers.req_pool_indices[:bs],
        seq_lens=buffers.seq_lens[:bs],
        seq_lens_cpu=buffers.seq_lens_cpu[:bs],
        seq_lens_sum=bs * fill,
        out_cache_loc=buffers.out_cache_loc[: bs * n],
        spec_info=cap_spec,
    )
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    be.init_forward_metadata_in_graph(cap)
    q, k, v = _qkv(bs * n, seed=0)
    be.forward(q, k, v, layer, cap)  # the captured forward
    gs = be._graphs[mode][be.layer_config(layer)]
    ptrs = {name: getattr(gs, name).data_ptr() for name in ("kv_indptr", "kv_indices", "kv_lens")}

    for rnd, kv_lens in enumerate([[9 + n, 40 + n, 17 + n], [30 + n, 5 + n]]):  # replays: raw_bs 3, then 2
        reqs, masks, fb = _batch(runner, mode, n, kv_lens, seed=20 + rnd)
        B = fb.batch_size
        buffers.seq_lens[:B], buffers.seq_lens_cpu[:B] = fb.seq_lens, fb.seq_lens_cpu  # fill_from
        buffers.seq_lens[B:], buffers.seq_lens_cpu[B:] = fill, fill
        buffers.req_pool_indices[:B] = fb.req_pool_indices
        buffers.req_pool_indices[B:] = 0
        view = _sglang_replay_view(_FB(**vars(fb)), buffers, bs, B, n, fill, sg_mode)
        assert view.num_padding == bs - B and view.batch_size == bs
        be.init_forward_metadata_out_graph(view)
        assert ptrs == {name: getattr(gs, name).data_ptr() for name in ptrs} and set(gs.plans) == {bs}
        q, k, v = _qkv(bs * n, seed=7 + rnd)
        loc = torch.cat([fb.out_cache_loc, torch.zeros((bs - B) * n, dtype=torch.int64)])
        out = be.forward(q, k, v, layer, SimpleNamespace(**{**vars(fb), "out_cache_loc": loc}))  # graph replay
        dense = dense_reference(runner, reqs, layer, q[: B * n], [n] * B, masks=masks)
        torch.testing.assert_close(out[: B * n], dense, **TOL)


@pytest.mark.parametrize("provider", ["triton", "toy", "fa3"])
def test_draft_graph_runner_protocol(provider, monkeypatch):
    """What SGLang's EAGLEDraftCudaGraphRunner does with the container, in both releases (with
    attnplug's triton and with the toy provider, which re-plans on the host):
    ``init_cuda_graph_state(max_bs, max_bs * topk)``, ``attn_backends[0].get_cuda_graph_seq_len_fill_value()``;
    capture over fill-value rows; replay with ``batch_size``, ``seq_lens(_cpu)`` and
    ``req_pool_indices`` swapped for the padded buffers and NO ``num_padding`` (padded rows are planned
    like real ones, reading a stale pool row), then ``init_forward_metadata_out_graph(fb)``."""
    topk, steps, max_bs = 2, 3, 4
    if provider == "toy":
        _toy_provider()
    if provider == "fa3":
        _fa3_standin(monkeypatch)
    runner = make_runner(4, is_draft_worker=True)
    layer = make_layer(0)
    be = make_draft(runner, topk, steps, provider=provider)
    be.init_cuda_graph_state(max_bs, max_bs * topk)
    fill = be.attn_backends[0].get_cuda_graph_seq_len_fill_value()
    bs = 4
    pool_rows = torch.zeros(max_bs, dtype=torch.int64)
    cap = _FB(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        req_pool_indices=pool_rows[:bs],
        seq_lens=torch.full((bs,), fill),
        seq_lens_cpu=torch.full((bs,), fill),
        seq_lens_sum=bs * fill,
        spec_info=SimpleNamespace(kv_indptr=None, kv_indices=None),
    )
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    be.init_forward_metadata_in_graph(cap)
    for seed, seq in enumerate([[7, 13, 9], [10, 3]]):
        reqs, fb, draft_slots = _draft_batch(runner, topk, steps, seq, seed=seed)
        B = len(seq)
        pool_rows[:B] = fb.req_pool_indices
        pool_rows[B:] = 5  # stale rows of earlier batches: SGLang does not reset them here
        pad = torch.full((bs - B,), fill)
        rfb = _FB(
            **{
                **vars(fb),
                **dict(
                    batch_size=bs,
                    req_pool_indices=pool_rows[:bs],
                    seq_lens=torch.cat([fb.seq_lens, pad]),
                    seq_lens_cpu=torch.cat([fb.seq_lens_cpu, pad]),
                ),
            }
        )
        be.init_forward_metadata_out_graph(rfb)
        for i, (q, out) in enumerate(_run_draft_steps(be, rfb, draft_slots, layer, seed=3 + seed, rows=bs * topk)):
            torch.testing.assert_close(
                out[: B * topk], _dense_step(runner, reqs, layer, draft_slots, i, q[: B * topk]), **TOL
            )
            assert list(be._graphs[i][be.attn_backends[0].layer_config(layer)].plans) == [bs * topk]


def test_draft_factory_public_methods_build_ours(hooked_factory, monkeypatch):
    """SGLang's public ``create_decode_backend`` / ``create_draft_extend_backend`` (both modes of
    ``speculative_attention_mode``), through our hook, on the installed release's protocol."""
    from attnplug.sglang_adapter.draft import AttnplugMultiStepDraftBackend

    for attn_mode in ("prefill", "decode"):
        monkeypatch.setattr(
            hooked_factory, "get_spec", lambda m=attn_mode: SimpleNamespace(speculative_attention_mode=m), raising=False
        )
        with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
            dec = _factory(_draft_runner(), "attnplug_triton").create_decode_backend()
            ext = _factory(_draft_runner(), "attnplug_triton").create_draft_extend_backend()
        assert type(dec) is AttnplugMultiStepDraftBackend, attn_mode
        assert type(ext).__name__ == "AttnplugDraftExtendBackend", attn_mode
        for b in [dec, ext, *dec.attn_backends]:
            assert b.decode_attention_backend_str == b.prefill_attention_backend_str == "attnplug_triton"


@pytest.mark.parametrize("provider", ["triton", "fa3", "flashinfer"])
def test_every_provider_declares_sglang_verify_and_draft_graphs(provider, monkeypatch):
    """What decides whether SGLang captures attnplug's speculative steps: SGLang calls the target
    backend's ``init_cuda_graph_state(max_bs, max_bs * num_draft_tokens)`` for TARGET_VERIFY graphs and
    the draft container's for draft decode, and has no fall-back (a refusal stops the start). Each
    provider's declared support must cover decode and verify graphs (tree masks through
    ``GraphState.update``), so neither is refused; triton and fa3 (stand-in) build the states here
    (the flashinfer provider needs CUDA: its declaration, and its tree family's part)."""
    from attnplug.core.providers import get_provider_cls

    g = get_provider_cls(provider).graph_support
    assert g.decode and g.verify, (provider, g)
    if provider == "flashinfer":
        from attnplug.core.providers.flashinfer import FlashInferGraph, FlashInferProvider

        assert FlashInferProvider.graph_cls is FlashInferGraph
        return
    if provider == "fa3":
        _fa3_standin(monkeypatch)
    runner = make_runner(4)
    be = make_backend(runner, provider, f"attnplug_{provider}")
    assert not be.graph_refusal
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * 8)  # EAGLE topk 4 / 8 draft tokens; n-gram alike
    assert be._graphs["verify"] and be._graphs["decode"]
    assert all(gs.q == 8 and not gs.chain for gs in be._graphs["verify"].values())
    draft = make_draft(make_runner(4, is_draft_worker=True), 4, 3, provider=provider)
    draft.init_cuda_graph_state(4, 4 * 4)


@pytest.mark.parametrize("provider", ["triton", "fa3", "toychain"])
def test_draft_extend_graph_capture_and_replay(provider, monkeypatch):
    """EAGLE draft extend in CUDA graphs, as SGLang's EAGLEDraftExtendCudaGraphRunner drives the backend
    (both releases): ``init_cuda_graph_state(max_bs, max_bs * W)``, capture over fill-value rows, replays
    of padded batches (``W`` tokens a request after its prefix; padded rows: pool row 0, ``seq_lens`` =
    the fill value, ``W`` tokens) through ``init_forward_metadata_out_graph``; outputs of the real rows
    equal the eager backend's and dense causal attention. SGLang's capture check (``isinstance`` of its
    listed backend types) passes for the draft-extend class only."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from attnplug.sglang_adapter.draft import AttnplugDraftExtendBackend

    if provider == "fa3":
        _fa3_standin(monkeypatch)
    if provider == "toychain":  # re-plans on the host from seq_lens_cpu / extend_seq_lens_cpu, as FlashInfer
        _toy_provider().register_chain()
    mode = compat.sglang_forward_mode()
    de = getattr(mode, "DRAFT_EXTEND_V2", None) or mode.DRAFT_EXTEND
    W, max_bs, bs = 4, 4, 4
    runner = make_runner(4, is_draft_worker=True)
    layer = make_layer(0)
    assert compat.declare_draft_extend_graphs(AttnplugDraftExtendBackend)
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        be = AttnplugDraftExtendBackend(runner, backend_name=f"attnplug_{provider}", provider=provider)
    assert isinstance(be, FlashInferAttnBackend) and not isinstance(make_backend(runner), FlashInferAttnBackend)
    be.init_cuda_graph_state(max_bs, max_bs * W)
    assert set(be._graphs) == {"draft_extend"} and all(
        gs.chain and gs.q == W for gs in be._graphs["draft_extend"].values()
    )
    fill = be.get_cuda_graph_seq_len_fill_value()
    cap = SimpleNamespace(
        forward_mode=de,
        batch_size=bs,
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=torch.full((bs,), fill),
        seq_lens_cpu=torch.full((bs,), fill),
        extend_seq_lens=torch.full((bs,), W, dtype=torch.int32),
        extend_seq_lens_cpu=[W] * bs,
        out_cache_loc=torch.zeros(bs * W, dtype=torch.int64),
        out_cache_loc_is_physical=False,
        spec_info=SimpleNamespace(),
        encoder_lens=None,
        kv_loc_plan=None,
    )
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    gs = next(iter(be._graphs["draft_extend"].values()))
    ptrs = [gs.kv_indices.data_ptr(), gs.kv_indptr.data_ptr(), gs.mask.data_ptr()]
    for seed, prefix in enumerate([[7, 13, 9], [10, 3], [5, 6, 8, 11]]):
        B = len(prefix)
        reqs = Requests(runner, kv_lens=[p + W for p in prefix], prefix=prefix, seed=20 + seed)
        fb = reqs.batch(de, q_lens=[W] * B, spec_info=SimpleNamespace())
        pad = bs - B
        # SGLang counts only the accepted tokens in seq_lens / extend_seq_lens; every request still runs W
        # tokens after its prefix (seq_lens - extend_seq_lens), as SGLang's own backends read them
        ext = torch.tensor([W - (b + seed) % 3 for b in range(B)] + [W] * pad, dtype=torch.int32)
        seq = torch.cat([fb.seq_lens - (W - ext[:B]).long(), torch.full((pad,), fill)])
        view = SimpleNamespace(
            **{
                **vars(fb),
                **dict(
                    batch_size=bs,
                    req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
                    seq_lens=seq,
                    seq_lens_cpu=seq.clone(),
                    out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad * W, dtype=torch.int64)]),
                    spec_info=SimpleNamespace(extend_seq_lens_tensor=ext, extend_seq_lens_cpu=ext.tolist()),
                ),
            }
        )
        be.init_forward_metadata_out_graph(view)
        assert [gs.kv_indices.data_ptr(), gs.kv_indptr.data_ptr(), gs.mask.data_ptr()] == ptrs and set(gs.plans) == {bs}
        q, k, v = _qkv(bs * W, seed=30 + seed)
        out = be.forward(q, k, v, layer, view)  # the captured plan, refreshed in place
        eager = make_backend(runner, provider, f"attnplug_{provider}")
        eager.init_forward_metadata(fb)
        ref = eager.forward(q[: B * W], k[: B * W], v[: B * W], layer, fb)
        torch.testing.assert_close(out[: B * W], ref, **TOL)
        torch.testing.assert_close(out[: B * W], dense_reference(runner, reqs, layer, q[: B * W], [W] * B), **TOL)
    assert be._stats.forwards.get("GRAPH_" + de.name) == 4
