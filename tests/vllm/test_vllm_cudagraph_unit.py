"""Engine-free tests of the adapter's CUDA-graph / EAGLE-draft hooks (vLLM's CPU platform captures
no graphs, so they run at the builder / impl level): capture-time metadata of padded batches,
in-place replay updates, and draft-step sequences as vLLM's proposers drive them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

Hq, Hkv, D, P, NUM_BLOCKS, DT, SCALE = 4, 2, 32, 4, 48, torch.float32, 0.17


@pytest.fixture(scope="module")
def env():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return SimpleNamespace(VllmConfig=VllmConfig)


def make(env, name, backend_name="AttnplugTritonBackend", max_num_seqs=8):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.vllm_adapter import backend as B

    backend = getattr(B, backend_name)
    cfg = env.VllmConfig()
    cfg.scheduler_config.max_num_seqs = max_num_seqs
    impl = backend.get_impl_cls()(Hq, D, SCALE, Hkv, None, None, "auto", None)
    cfg.compilation_config.static_forward_context[name] = SimpleNamespace(impl=impl)
    spec = FullAttentionSpec(block_size=P, num_kv_heads=Hkv, head_size=D, dtype=DT)
    builder = backend.get_builder_cls()(spec, [name], cfg, torch.device("cpu"))
    return impl, builder


class Batch:
    """Decode requests on a random paged cache, described the way vLLM's runner does (padded rows:
    seq_len 0, no query token, null-block table row, slot -1)."""

    def __init__(self, seq_lens, bs=None, seed=0, width=8):
        g = torch.Generator().manual_seed(seed)
        self.B, self.bs = len(seq_lens), bs or len(seq_lens)
        self.kv_cache = torch.randn(NUM_BLOCKS, P, Hkv, 2 * D, generator=g, dtype=DT).permute(0, 2, 1, 3)
        perm = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1  # block 0: vLLM's null block
        self.block_table = torch.zeros(self.bs, width, dtype=torch.int32)
        used = 0
        for b, s in enumerate(seq_lens):
            n = -(-(s + 4) // P)  # room for a few draft tokens
            self.block_table[b, :n] = perm[used : used + n].to(torch.int32)
            used += n
        self.seq_lens = torch.zeros(self.bs, dtype=torch.int32)
        self.seq_lens[: self.B] = torch.tensor(seq_lens, dtype=torch.int32)
        self.q = torch.randn(self.bs, Hq, D, generator=g, dtype=DT)

    def slots(self):
        pos = self.seq_lens[: self.B].long() - 1
        real = self.block_table[torch.arange(self.B), pos // P].long() * P + pos % P
        return torch.cat([real, torch.full((self.bs - self.B,), -1, dtype=torch.long)])

    def cam(self, num_reqs=None):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = num_reqs or self.bs
        qsl = torch.cat([torch.arange(self.B + 1), torch.full((n - self.B,), self.B)]).to(torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=self.seq_lens[:n],
            num_reqs=n,
            num_actual_tokens=n,
            max_query_len=1,
            max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=self.block_table[:n],
            slot_mapping=self.slots()[:n],
        )


def forward(impl, kv_cache, md, q):
    out = torch.full_like(q, 7.0)
    impl.forward(None, q, q, q, kv_cache, md, out)
    return out


def reference(b: Batch, impl):
    """The core's float32 reference provider on the real requests."""
    from attnplug.core import BatchMetadata, ForwardMode, PagedAttention
    from attnplug.vllm_adapter.compat import split_kv_cache

    B = b.B
    attn = PagedAttention(impl.core_config(P, DT), "reference", "cpu")
    attn.plan(
        BatchMetadata.from_block_table(
            ForwardMode.DECODE, torch.arange(B + 1, dtype=torch.int32), b.block_table[:B], b.seq_lens[:B], P
        )
    )
    k, v = split_kv_cache(b.kv_cache, D)
    return attn.run(b.q[:B].contiguous(), k, v)


def graph_buffers(builder, md):
    plan = md.plan_for(next(iter(builder.attention)))
    gs = next(iter(md.graphs.states.values()))
    ts = [plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, plan.kv_lens, plan.qo_indptr, gs.kv_indices]
    ts += [v for v in vars(plan.state).values() if isinstance(v, torch.Tensor)] if plan.state is not None else []
    return plan, [t.data_ptr() for t in ts]


def check_csr(builder, md, b: Batch):
    """Graph plan rows ``< B`` == the eager plan of the real batch; padded rows hold the fill."""
    from attnplug.core.cuda_graph import FILL_SEQ_LEN
    from attnplug.vllm_adapter.compat import null_block_id

    plan = md.plan_for(next(iter(builder.attention)))
    eager = builder._build_eager(0, b.cam(b.B)).plans[next(iter(builder.attention))]
    B, nnz = b.B, int(eager.kv_indptr[-1])
    assert torch.equal(plan.kv_indptr[: B + 1], eager.kv_indptr)
    assert torch.equal(plan.kv_indices[:nnz], eager.kv_indices)
    assert torch.equal(plan.kv_last_page_len[:B], eager.kv_last_page_len)
    assert torch.equal(plan.kv_lens[:B], eager.kv_lens)
    pad = slice(B, md.bs)
    assert bool((plan.kv_lens[pad] == FILL_SEQ_LEN).all()), plan.kv_lens
    assert bool((plan.kv_last_page_len[pad] == FILL_SEQ_LEN).all())
    assert bool(((plan.kv_indptr[B + 1 : md.bs + 1] - plan.kv_indptr[B : md.bs]) == 1).all())
    pad_pages = plan.kv_indices[plan.kv_indptr[B : md.bs].long()]
    assert bool((pad_pages == null_block_id()).all()), pad_pages
    return eager


def test_capture_padded_batch_matches_eager_then_replay_updates_in_place(env):
    from attnplug.vllm_adapter.backend import AttnplugGraphMetadata, AttnplugMetadata, uniform_rows

    impl, builder = make(env, "cg_capture")
    key = next(iter(builder.attention))
    b = Batch([9, 1, 14], bs=5)
    md = builder.build_for_cudagraph_capture(b.cam())
    assert isinstance(md, AttnplugGraphMetadata) and md.bs == 5
    check_csr(builder, md, b)
    out = forward(impl, b.kv_cache, md, b.q)
    eager = forward(impl, b.kv_cache, builder._build_eager(0, b.cam(b.B)), b.q)
    torch.testing.assert_close(out[:3], eager[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:3], reference(b, impl), atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(out[3:]).all()), "padded rows read valid memory"
    plan0, ptrs0 = graph_buffers(builder, md)

    # replay: a new real batch of another size padded to the captured bs goes through build()
    b2 = Batch([22, 5], bs=5, seed=1)
    b2.block_table[2:] = 5  # stale ids in the padded rows: the fill must not rely on vLLM's null-block rows
    md2 = builder.build(0, b2.cam())
    assert isinstance(md2, AttnplugGraphMetadata)
    plan2, ptrs2 = graph_buffers(builder, md2)
    assert plan2 is plan0 and ptrs2 == ptrs0, "replay must update the captured buffers in place"
    check_csr(builder, md2, b2)
    out2 = forward(impl, b2.kv_cache, md2, b2.q)
    torch.testing.assert_close(
        out2[:2], forward(impl, b2.kv_cache, builder._build_eager(0, b2.cam(2)), b2.q)[:2], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(out2[:2], reference(b2, impl), atol=1e-5, rtol=1e-5)
    # a vLLM that pads the tokens of a uniform batch but not its requests (num_reqs = real rows)
    b3 = Batch([3, 17, 6], bs=3, seed=7)
    cam3 = b3.cam()
    cam3.num_actual_tokens = 5
    md3 = builder.build(0, cam3)
    assert isinstance(md3, AttnplugGraphMetadata) and md3.bs == 5 and md3.plan_for(key) is plan0
    out3 = forward(impl, b3.kv_cache, md3, torch.cat([b3.q, b3.q[:2]]))
    assert bool((md3.plan_for(key).kv_lens[3:5] == 1).all())
    torch.testing.assert_close(out3[:3], reference(b3, impl), atol=1e-5, rtol=1e-5)
    # a mixed batch never takes the graph path
    mixed = b2.cam()
    mixed.query_start_loc_cpu = torch.tensor([0, 2, 3, 3, 3, 3], dtype=torch.int32)
    assert uniform_rows(mixed) is None
    with pytest.raises(ValueError, match="CUDA-graph capture of this batch"):
        builder.build_for_cudagraph_capture(mixed)
    assert isinstance(builder._build_eager(0, b2.cam(2)), AttnplugMetadata)


def verify_cam(b, n, q):
    """vLLM's metadata of a spec-verify batch: ``q`` tokens for each of ``b``'s real requests, ``n - B``
    padding rows with none."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    ql = [q] * b.B + [0] * (n - b.B)
    qsl = torch.tensor([0] + ql).cumsum(0).to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=b.seq_lens[:n],
        num_reqs=n,
        num_actual_tokens=n * q,
        max_query_len=q,
        max_seq_len=int(b.seq_lens.max()),
        block_table_tensor=b.block_table[:n],
        slot_mapping=torch.full((n * q,), -1, dtype=torch.long),
    )


def verify_reference(b, impl, x, q):
    """The float32 reference of ``b``'s real requests, ``q`` causal tokens each."""
    from attnplug.core import BatchMetadata, ForwardMode, PagedAttention
    from attnplug.vllm_adapter.compat import split_kv_cache

    B = b.B
    ref = PagedAttention(impl.core_config(P, DT), "reference", "cpu")
    ref.plan(
        BatchMetadata.from_block_table(
            ForwardMode.MIXED, torch.arange(B + 1, dtype=torch.int32) * q, b.block_table[:B], b.seq_lens[:B], P
        )
    )
    k, v = split_kv_cache(b.kv_cache, D)
    return ref.run(x[: B * q].contiguous(), k, v)


def test_capture_and_replay_uniform_spec_verify_batch(env):
    """UNIFORM_BATCH: verify batches of q = 1 + num_speculative_tokens causal tokens per request,
    padded by vLLM, run through the core's verify graphs with the chain mask built on the device."""
    from attnplug.core.cuda_graph import FILL_SEQ_LEN
    from attnplug.core.draft import build_tree_verify_mask
    from attnplug.vllm_adapter.backend import AttnplugGraphMetadata

    q = 3
    impl, builder = make(env, "cg_verify")
    key = next(iter(builder.attention))

    def cam_of(b, n):
        return verify_cam(b, n, q)

    def check(b, md):
        B, bs = b.B, md.bs
        g = torch.Generator().manual_seed(B)
        x = torch.randn(bs * q, Hq, D, generator=g, dtype=DT)
        out = forward(impl, b.kv_cache, md, x)
        eager = forward(impl, b.kv_cache, builder._build_eager(0, cam_of(b, B)), x)
        torch.testing.assert_close(out[: B * q], eager[: B * q], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[: B * q], verify_reference(b, impl, x, q), atol=1e-5, rtol=1e-5)
        plan = md.plan_for(key)
        mi = [int(t) for t in plan.mask_indptr[: bs + 1]]
        chain = torch.arange(q)[None].repeat(B, 1) - 1
        want = build_tree_verify_mask(chain, b.seq_lens[:B] - q)
        assert torch.equal(plan.mask[: mi[B]].bool(), want), "real rows: prefix + causal chain"
        assert bool(plan.mask[mi[B] : mi[bs]].bool().all()), "padded rows: all-True mask blocks"
        assert bool((plan.kv_lens[B:bs] == FILL_SEQ_LEN + q).all())
        assert torch.equal(plan.mask_free[:B], b.seq_lens[:B] - q)
        return plan

    b = Batch([9, 3, 14], bs=5, seed=5)
    md = builder.build_for_cudagraph_capture(cam_of(b, 5))
    assert isinstance(md, AttnplugGraphMetadata) and md.num_tokens == 15
    plan0, ptrs0 = graph_buffers(builder, md)
    check(b, md)
    b2 = Batch([25, 4], bs=5, seed=6)
    b2.block_table[2:] = 9
    md2 = builder.build(0, cam_of(b2, 5))
    assert isinstance(md2, AttnplugGraphMetadata)
    plan2, ptrs2 = graph_buffers(builder, md2)
    assert plan2 is plan0 and ptrs2 == ptrs0 and plan2.mask.data_ptr() == plan0.mask.data_ptr()
    check(b2, md2)


def _draft_step(b: Batch, impl, cam):
    """What vLLM's V1 proposer does between draft steps: seq_lens += 1 (in place), a new slot
    mapping, uniform single-token query_start_loc; then the new token's K/V is written."""
    B = b.B
    cam.num_actual_tokens, cam.max_query_len = B, 1
    cam.query_start_loc = torch.arange(B + 1, dtype=torch.int32)
    cam.query_start_loc_cpu = torch.arange(B + 1, dtype=torch.int32)
    cam.seq_lens += 1
    cam.max_seq_len += 1
    cam.slot_mapping = b.slots()[:B]
    g = torch.Generator().manual_seed(int(cam.seq_lens.sum()))
    kv = torch.randn(B, Hkv, 2 * D, generator=g, dtype=DT)
    impl.do_kv_cache_update(None, kv[..., :D], kv[..., D:], b.kv_cache, cam.slot_mapping)
    b.q = torch.randn(b.bs, Hq, D, generator=g, dtype=DT)


def test_build_for_drafting_sequence_matches_eager_and_reference(env):
    from attnplug.vllm_adapter.backend import AttnplugGraphMetadata

    impl, builder = make(env, "cg_draft_v1")
    b = Batch([6, 13, 3], seed=2)
    cam = b.cam()
    for step in range(1, 4):
        _draft_step(b, impl, cam)
        md = builder.build_for_drafting(cam, draft_index=step)
        assert isinstance(md, AttnplugGraphMetadata) and md.bs == 3
        out = forward(impl, b.kv_cache, md, b.q)
        eager = forward(impl, b.kv_cache, builder._build_eager(0, cam), b.q)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, reference(b, impl), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first", ["build_for_drafting", "build"])
def test_update_draft_decode_metadata_in_place(env, first):
    """V2's fused path: build once (V2 calls build()), then only update_draft_decode_metadata
    between steps (the speculator mutates the persistent seq_lens / block table it references)."""
    impl, builder = make(env, f"cg_draft_v2_{first}")
    builder._spec_tokens = 2  # V2's fused drafting runs with speculative decoding configured
    assert builder.supports_draft_decode_metadata_update
    b = Batch([7, 2, 11, 4], seed=3)
    cam = b.cam()
    _draft_step(b, impl, cam)
    md = builder.build_for_drafting(cam, draft_index=1) if first == "build_for_drafting" else builder.build(0, cam)
    _, ptrs = graph_buffers(builder, md)
    for _step in range(2, 5):
        _draft_step(b, impl, cam)
        stale = forward(impl, b.kv_cache, md, b.q)
        builder.update_draft_decode_metadata(md)
        assert graph_buffers(builder, md)[1] == ptrs
        out = forward(impl, b.kv_cache, md, b.q)
        want = reference(b, impl)
        torch.testing.assert_close(
            out, forward(impl, b.kv_cache, builder._build_eager(0, cam), b.q), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(stale, want, atol=1e-4), "the update must matter"


@pytest.fixture
def toy(monkeypatch):
    """``tests/toy_provider.py`` (one file + one registry line) run by every attnplug backend: a
    provider that re-plans on the host before a replay, as FlashInfer does, with the reference's math."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import toy_provider

    toy_provider.register()
    monkeypatch.setenv("ATTNPLUG_PROVIDER_OVERRIDE", toy_provider.TOY)
    return toy_provider


@pytest.mark.parametrize("spec", [0, 2])
def test_host_planning_provider_graph_builds_get_exact_host_lengths(env, monkeypatch, toy, spec):
    """A provider that plans on the host (FlashInfer; here the toy provider, no adapter edit): single-token
    decode graphs; a graph build hands the core vLLM's host sequence lengths - ``seq_lens_cpu_upper_bound``
    without speculative decoding (exact then), else the device values (never the optimistic bound);
    its drafts build eagerly and never update in place."""
    from vllm.v1.attention.backend import AttentionCGSupport as CG

    from attnplug.core import UnsupportedFeature
    from attnplug.core.cuda_graph import GraphState
    from attnplug.vllm_adapter.backend import AttnplugGraphMetadata, AttnplugMetadata

    calls = []
    one_launch = GraphState.update_from_block_table
    monkeypatch.setattr(
        GraphState, "update_from_block_table", lambda gs, *a, **k: calls.append(k) or one_launch(gs, *a, **k)
    )
    impl, builder = make(env, f"cg_toy_host_{spec}")
    assert builder.get_cudagraph_support(None, None) is CG.UNIFORM_SINGLE_TOKEN_DECODE
    assert not builder.supports_draft_decode_metadata_update
    builder._spec_tokens = spec
    b = Batch([6, 13, 3], bs=4, seed=4)
    cam = b.cam()
    cam.seq_lens_cpu_upper_bound = b.seq_lens + 5  # optimistic (async spec decode): usable only when exact
    if spec == 0:
        cam.seq_lens_cpu_upper_bound = b.seq_lens.clone()
    md = builder.build_for_cudagraph_capture(cam)
    assert isinstance(md, AttnplugGraphMetadata)
    (kw,) = calls
    assert kw["host_seq_lens"].device.type == "cpu" and torch.equal(kw["host_seq_lens"], b.seq_lens)
    from_bound = kw["host_seq_lens"].data_ptr() == cam.seq_lens_cpu_upper_bound.data_ptr()
    assert from_bound == (spec == 0), "the host bound, and only where it is exact"
    torch.testing.assert_close(forward(impl, b.kv_cache, md, b.q)[:3], reference(b, impl), atol=1e-5, rtol=1e-5)
    b2 = Batch([11, 2], bs=4, seed=5)  # a replay of another batch through build()
    md2 = builder.build(0, b2.cam())
    assert isinstance(md2, AttnplugGraphMetadata) and len(calls) == 2
    torch.testing.assert_close(forward(impl, b2.kv_cache, md2, b2.q)[:2], reference(b2, impl), atol=1e-5, rtol=1e-5)
    assert isinstance(builder.build_for_drafting(cam, draft_index=1), AttnplugMetadata)
    with pytest.raises(
        UnsupportedFeature, match="in-place .capturable. draft metadata updates.*'toy'.*re-plans on the host"
    ):
        builder.update_draft_decode_metadata(md)


def test_host_planning_chain_provider_verify_graphs(env, monkeypatch, toy):
    """A provider that re-plans on the host but replays causal-chain verify from a device page table with
    host lengths (FlashInfer's declaration; here the chain toy): UNIFORM_BATCH, and the builder serves
    vLLM's captured verify batches from a chain family, handing the core the exact host lengths (the
    device values with speculative decoding), first at capture, then at every replay-time build."""
    from vllm.v1.attention.backend import AttentionCGSupport as CG

    from attnplug.core.cuda_graph import GraphState
    from attnplug.vllm_adapter.backend import AttnplugGraphMetadata

    toy.register_chain()
    monkeypatch.setenv("ATTNPLUG_PROVIDER_OVERRIDE", toy.TOY_CHAIN)
    calls = []
    one_launch = GraphState.update_from_block_table
    monkeypatch.setattr(
        GraphState, "update_from_block_table", lambda gs, *a, **k: calls.append((gs, k)) or one_launch(gs, *a, **k)
    )
    q = 3
    impl, builder = make(env, "cg_toy_chain")
    builder._spec_tokens = q - 1
    assert builder.get_cudagraph_support(None, None) is CG.UNIFORM_BATCH
    assert not builder.supports_draft_decode_metadata_update  # its drafts still build eagerly
    for step, (lens, seed) in enumerate([([9, 3, 14], 5), ([25, 4], 6)]):
        b = Batch(lens, bs=5, seed=seed)
        cam = verify_cam(b, 5, q)
        cam.seq_lens_cpu_upper_bound = b.seq_lens + 5  # optimistic: never used with spec decode
        md = builder.build_for_cudagraph_capture(cam) if step == 0 else builder.build(0, cam)
        assert isinstance(md, AttnplugGraphMetadata) and md.graphs.q == q
        gs, kw = calls[-1]
        assert gs.chain and type(gs.graph).__name__ == "ToyChainGraph" and len(calls) == step + 1
        assert torch.equal(kw["host_seq_lens"], b.seq_lens[:5]) and kw["host_seq_lens"].device.type == "cpu"
        x = torch.randn(5 * q, Hq, D, generator=torch.Generator().manual_seed(step), dtype=DT)
        out = forward(impl, b.kv_cache, md, x)
        torch.testing.assert_close(out[: b.B * q], verify_reference(b, impl, x, q), atol=1e-5, rtol=1e-5)


def test_support_levels_are_honest_per_provider(env, monkeypatch):
    from vllm.v1.attention.backend import AttentionCGSupport as CG

    from attnplug.vllm_adapter import backend as B

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    level = {
        n: getattr(B, n).get_builder_cls().get_cudagraph_support(None, None)
        for n in ("AttnplugTritonBackend", "AttnplugFA3Backend", "AttnplugFlashInferBackend")
    }
    # from each provider's graph_support: decode + causal-chain verify from the device block table (device
    # refresh, or FlashInfer's host re-plan from host lengths) -> UNIFORM_BATCH
    assert level == {
        "AttnplugTritonBackend": CG.UNIFORM_BATCH,
        "AttnplugFA3Backend": CG.UNIFORM_BATCH,
        "AttnplugFlashInferBackend": CG.UNIFORM_BATCH,
    }
    assert {n: getattr(B, n).get_builder_cls()._cudagraph_support for n in level} == level
    # spec decode: verify graphs only where their static buffers fit the budget
    triton = B.AttnplugTritonBackend.get_builder_cls()

    def cfg(seqs, max_len):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=3),
            model_config=None,
            scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_model_len=max_len),
            compilation_config=SimpleNamespace(max_cudagraph_capture_size=seqs),
        )

    spec16 = SimpleNamespace(block_size=16)
    assert triton.get_cudagraph_support(cfg(8, 2048), spec16) is CG.UNIFORM_BATCH
    assert B.verify_scratch_bytes(cfg(1024, 524288), 16) > B.VERIFY_SCRATCH_BUDGET
    assert triton.get_cudagraph_support(cfg(1024, 524288), spec16) is CG.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.setenv("ATTNPLUG_PROVIDER_OVERRIDE", "reference")
    assert B.AttnplugTritonBackend.get_builder_cls().get_cudagraph_support(None, None) is CG.NEVER


def test_reference_provider_refuses_graphs_and_drafts_eagerly(env, monkeypatch):
    from attnplug.core import UnsupportedFeature
    from attnplug.vllm_adapter.backend import AttnplugMetadata

    monkeypatch.setenv("ATTNPLUG_PROVIDER_OVERRIDE", "reference")
    impl, builder = make(env, "cg_reference")
    assert not builder.supports_draft_decode_metadata_update
    b = Batch([5, 9], seed=4)
    with pytest.raises(UnsupportedFeature, match="attnplug.*ATTNPLUG_TRITON.*CUDA-graph capture.*'reference'"):
        builder.build_for_cudagraph_capture(b.cam())
    md = builder.build_for_drafting(b.cam(), draft_index=1)
    assert isinstance(md, AttnplugMetadata)
    torch.testing.assert_close(forward(impl, b.kv_cache, md, b.q)[:2], reference(b, impl), atol=1e-6, rtol=1e-6)
    with pytest.raises(UnsupportedFeature, match="in-place .capturable. draft metadata updates.*'reference'"):
        builder.update_draft_decode_metadata(md)


def test_decode_graphs_read_the_shared_prefix_once_when_enabled(env, monkeypatch, tmp_path):
    """ATTNPLUG_CASCADE_GRAPHS=1: the decode graph family cuts the blocks every real request shares
    (found on the device at each build) and the replayed launches still give the reference; the
    proof markers count the builds that cut a prefix (``cascade_graph_updates``)."""
    from attnplug.vllm_adapter.backend import STATS

    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "1")
    monkeypatch.setenv("ATTNPLUG_CASCADE", "always")
    monkeypatch.setenv("ATTNPLUG_MARKER_DIR", str(tmp_path))
    impl, builder = make(env, "cg_cascade")
    assert builder._graph_cascade
    b = Batch([13, 10, 17], bs=4, seed=3)
    b.block_table[1:3, :2] = b.block_table[0, :2]  # two shared blocks (8 tokens), as a prefix cache maps them
    n0, t0 = STATS["cascade_graph_updates"], STATS["cascade_graph_shared_tokens"]
    md = builder.build_for_cudagraph_capture(b.cam())
    gs = next(iter(md.graphs.states.values()))
    assert gs.cascade is not None and int(gs.cascade.kv_lens.sum()) == 2 * P
    assert (STATS["cascade_graph_updates"] - n0, STATS["cascade_graph_shared_tokens"] - t0) == (1, 2 * P)
    out = forward(impl, b.kv_cache, md, b.q)
    torch.testing.assert_close(out[:3], reference(b, impl), atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(out[3:]).all())
    b2 = Batch([9, 6], bs=4, seed=4)  # nothing shared: an empty prefix part, same captured buffers
    md2 = builder.build(0, b2.cam())
    assert int(gs.cascade.kv_lens.sum()) == 0
    assert STATS["cascade_graph_updates"] - n0 == 1, "a build that cut nothing is not counted"
    torch.testing.assert_close(forward(impl, b2.kv_cache, md2, b2.q)[:2], reference(b2, impl), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "2")
    with pytest.raises(ValueError, match="ATTNPLUG_CASCADE_GRAPHS must be 0 or 1"):
        make(env, "cg_cascade_bad")


BACKEND_NAMES = ("AttnplugTritonBackend", "AttnplugFA3Backend", "AttnplugFlashInferBackend")


def _spec_config(num_spec: int, seqs: int = 64, max_len: int = 17408):
    """The e2e harness's vLLM limits (``benchmarks/e2e/engine_run.py``) with ``num_spec`` draft tokens."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=num_spec),
        model_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_model_len=max_len),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=seqs),
    )


@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize("num_spec,v2", [(4, False), (2, True), (2, False), (4, True)])
def test_spec_verify_batches_get_full_graphs_under_both_runners(env, monkeypatch, name, num_spec, v2):
    """What vLLM reads to choose the graph mode of speculative batches: each builder's
    ``get_cudagraph_support(vllm_config, kv_cache_spec)`` (V1 runner: on the class; V2: on the instance -
    a classmethod, the same answer), folded by vLLM's own ``resolve_cudagraph_mode_and_sizes`` with
    ``uniform_decode_query_len = 1 + k``. Every provider must keep FULL graphs of uniform verify batches
    (not vLLM's fall-back "not supported with spec-decode ...; setting cudagraph_mode=PIECEWISE")."""
    import inspect

    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport as CG
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.vllm_adapter import backend as B

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    cls = getattr(B, name).get_builder_cls()
    assert isinstance(inspect.getattr_static(cls, "get_cudagraph_support"), classmethod)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    level = cls.get_cudagraph_support(_spec_config(num_spec), spec)
    assert level is CG.UNIFORM_BATCH, (name, level)
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
        max_cudagraph_capture_size=64,
    )
    mode = cc.resolve_cudagraph_mode_and_sizes(
        level, getattr(B, name).__name__, uniform_decode_query_len=1 + num_spec, use_v2_model_runner=v2
    )
    assert mode.decode_mode() == CUDAGraphMode.FULL and mode == CUDAGraphMode.FULL_AND_PIECEWISE, mode
    # the same resolution with a single-token-decode level falls back (the check above can fail)
    low = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        max_cudagraph_capture_size=8,
    )
    fallback = low.resolve_cudagraph_mode_and_sizes(
        CG.UNIFORM_SINGLE_TOKEN_DECODE, "X", uniform_decode_query_len=1 + num_spec, use_v2_model_runner=v2
    )
    assert fallback.decode_mode() != CUDAGraphMode.FULL


def test_both_runners_read_the_builders_cudagraph_support(env):
    """The two places vLLM asks (pins this release's code path): the V1 runner's
    ``_check_and_update_cudagraph_mode`` and the V2 runner's attention setup both take the minimum of
    the builders' ``get_cudagraph_support`` and hand it to ``resolve_cudagraph_mode_and_sizes``."""
    import inspect

    from vllm.v1.worker import gpu_model_runner as v1

    v1_src = inspect.getsource(v1.GPUModelRunner._check_and_update_cudagraph_mode)
    assert "get_cudagraph_support(" in v1_src and "resolve_cudagraph_mode_and_sizes(" in v1_src
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu import model_runner as v2

    assert "get_cudagraph_support(" in inspect.getsource(attn_utils)
    assert "resolve_cudagraph_mode_and_sizes(" in inspect.getsource(v2)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_verify_graph_family_is_a_chain_family(env, monkeypatch, name):
    """The builder's verify graphs (``q = 1 + k``) are causal-chain families (``GraphState(chain=True)``):
    FlashInfer replays them with its causal prefill template, planned from host lengths; the others read
    the chain mask the one-launch update writes. The provider's declared support covers them."""
    from attnplug.core.providers import get_provider_cls

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    from attnplug.vllm_adapter import backend as B

    g = get_provider_cls(getattr(B, name).provider()).graph_support
    assert g.chain_verify and g.decode
    if name == "AttnplugFlashInferBackend":
        from attnplug.core.providers.flashinfer import FlashInferChainVerifyGraph, FlashInferProvider

        assert FlashInferProvider.chain_graph_cls is FlashInferChainVerifyGraph and not g.device_refresh
