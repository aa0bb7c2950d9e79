"""attnplug's SGLang backend on MLA models (issue 45; attnplug/sglang_adapter/mla.py): SGLang's real
``MLATokenToKVPool`` and MLA ``RadixAttention`` layer (``attn_mqa``: 1 KV head, head dim R + Dr, v head
dim R), hand-built ForwardBatch-like objects. Oracle: a float64 MLA computed WITHOUT absorption from the
up-projected K/V of the latents read through ``req_to_token`` (independent of the core's metadata).
Also the factory's routing, the absorbed-MLA dispatch registration, refusals and CUDA-graph replay."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang_helpers import Requests

from attnplug.core import UnsupportedFeature
from attnplug.core.cuda_graph import FILL_SEQ_LEN

pytestmark = pytest.mark.sglang

H, R, DR, DN = 4, 64, 16, 32  # heads, kv_lora_rank, rope dim, nope (= v) dim of the un-absorbed model
SCALE = (DN + DR) ** -0.5


def make_runner(page_size: int, num_slots: int = 512, layers: int = 2, mha_dims: bool = False, **over):
    """``mha_dims``: the model config names DeepSeek's un-absorbed head dims (``hf_text_config``), so the
    backend runs SGLang's MHA prefill where the provider has a ragged prefill."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool

    r2t = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    kv = MLATokenToKVPool(
        size=num_slots,
        page_size=page_size,
        dtype=torch.float32,
        kv_lora_rank=R,
        qk_rope_head_dim=DR,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    mc = SimpleNamespace(
        is_encoder_decoder=False,
        attention_arch=AttentionArch.MLA,
        dtype=torch.float32,
        get_num_attention_heads=lambda tp: H // tp,
    )
    if mha_dims:
        mc.hf_text_config = SimpleNamespace(qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DN)
    runner = SimpleNamespace(
        device="cpu",
        page_size=page_size,
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
        kv_index_translator=None,
        model_config=mc,
        dtype=mc.dtype,
        kv_cache_dtype=torch.float32,
        is_draft_worker=False,
    )
    for k, v in over.items():
        setattr(runner, k, v)
    return runner


def mla_layer(layer_id: int = 0):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(H, R + DR, SCALE, num_kv_heads=1, layer_id=layer_id, v_head_dim=R)


def make_backend(runner, name="attnplug_triton"):
    """What SGLang's registry builds for ``--attention-backend name`` (attnplug's factory)."""
    import attnplug.sglang_adapter as adapter

    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        return adapter._factory(name, runner)


class MLARequests(Requests):
    """Requests in the runner's MLA pool: random page-aligned slots, the cached prefix's latents filled in."""

    def fill(self, pool, layer_id, slots, g) -> None:
        pool.get_key_buffer(layer_id)[slots] = torch.randn(len(slots), 1, R + DR, generator=g)


def absorbed_inputs(T, seed):
    """What SGLang's DeepSeek hands ``attn_mqa``: ``q [T, H*(R+Dr)]`` = cat(q_nope @ W_UK, q_pe) per head,
    ``k [T, 1, R+Dr]`` the new latent rows, ``v`` their first R columns; plus the model's pieces."""
    g = torch.Generator().manual_seed(seed)
    w_uk, w_uv = torch.randn(H, R, DN, generator=g) * R**-0.5, torch.randn(H, R, DN, generator=g) * R**-0.5
    q_nope, q_pe = torch.randn(T, H, DN, generator=g), torch.randn(T, H, DR, generator=g)
    q = torch.cat([torch.einsum("thn,hrn->thr", q_nope, w_uk), q_pe], -1).reshape(T, H * (R + DR))
    k = torch.randn(T, 1, R + DR, generator=g)
    return q, k, k[..., :R], dict(q_nope=q_nope, q_pe=q_pe, w_uk=w_uk, w_uv=w_uv)


def unabsorbed_reference(runner, reqs, layer, m, q_lens, masks=None):
    """Float64 MLA per request from the pool's latents (read through req_to_token): keys
    ``cat(c @ W_UK, k_pe)``, values ``c @ W_UV``; causal bottom-right or ``masks[b]``. -> ``[T, H, DN]``."""
    buf = runner.token_to_kv_pool.get_key_buffer(layer.layer_id)[:, 0].double()
    outs, t = [], 0
    for b, ql in enumerate(q_lens):
        n = reqs.kv_lens[b]
        rows = buf[runner.req_to_token_pool.req_to_token[reqs.rows[b], :n].long()]
        c, pe = rows[:, :R], rows[:, R:]
        k_nope = torch.einsum("kr,hrn->hkn", c, m["w_uk"].double())
        v = torch.einsum("kr,hrv->hkv", c, m["w_uv"].double())
        s = (
            torch.einsum("qhn,hkn->hqk", m["q_nope"][t : t + ql].double(), k_nope)
            + torch.einsum("qhd,kd->hqk", m["q_pe"][t : t + ql].double(), pe)
        ) * SCALE
        ok = masks[b] if masks is not None else torch.arange(n)[None] <= torch.arange(n - ql, n)[:, None]
        outs.append(torch.einsum("hqk,hkv->qhv", s.masked_fill(~ok[None], -math.inf).softmax(-1), v))
        t += ql
    return torch.cat(outs)


def up(out, m):
    return torch.einsum("thr,hrv->thv", out.view(out.shape[0], H, R).double(), m["w_uv"].double())


def tree_spec(kv_lens, n, seed=3):
    g = torch.Generator().manual_seed(seed)
    masks = []
    for kv in kv_lens:
        tree = torch.tril(torch.rand(n, n, generator=g) < 0.6) | torch.eye(n, dtype=torch.bool)
        tree[:, 0] = True
        masks.append(torch.cat([torch.ones(n, kv - n, dtype=torch.bool), tree], 1))
    flat = torch.cat([x.reshape(-1) for x in masks])
    return masks, SimpleNamespace(custom_mask=flat, draft_token_num=n, num_tokens_per_req=-1, kv_indptr=None)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["EXTEND", "DECODE", "TARGET_VERIFY"])
def test_mla_modes_match_unabsorbed_reference(page_size, mode):
    runner = make_runner(page_size)
    layer = mla_layer(0)
    if mode == "EXTEND":  # a fresh prompt, an extend on a cached prefix, a prefix ending mid-page
        kv, q_lens = [9, 41, 38], [9, 7, 17]
    elif mode == "DECODE":
        kv, q_lens = [9, 41, 3], [1, 1, 1]
    else:
        kv, q_lens = [12, 40], [4, 4]
    reqs = MLARequests(runner, kv, [k - q for k, q in zip(kv, q_lens)])
    masks, spec = tree_spec(kv, 4) if mode == "TARGET_VERIFY" else (None, None)
    fb = reqs.batch(getattr(ForwardMode, mode), q_lens, spec_info=spec)
    be = make_backend(runner)
    be.init_forward_metadata(fb)
    q, k, v, m = absorbed_inputs(sum(q_lens), seed=5)
    fwd = be.forward_decode if mode == "DECODE" else be.forward_extend
    out = fwd(q, k, v, layer, fb)
    assert out.shape == (sum(q_lens), H * R) and not out.isnan().any()
    written = runner.token_to_kv_pool.get_key_buffer(0)[fb.out_cache_loc]
    torch.testing.assert_close(written, k, rtol=0, atol=0)  # the new latents, at out_cache_loc
    torch.testing.assert_close(
        up(out, m), unabsorbed_reference(runner, reqs, layer, m, q_lens, masks), atol=2e-4, rtol=1e-3
    )
    assert be._stats.layer_runs == 1


def test_factory_routes_mla_and_registers_absorbed_dispatch():
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    from attnplug.sglang_adapter.mla import AttnplugMLAAttnBackend

    be = make_backend(make_runner(16), name="attnplug_triton")
    assert type(be) is AttnplugMLAAttnBackend and (be.num_kv_heads, be.head_dim, be.kv_lora_rank) == (1, R + DR, R)
    assert AttentionBackendRegistry.get_handler("attnplug_triton") is _dispatch_mla_subtype  # absorbed, every mode


@pytest.mark.parametrize(
    "mutate, feature",
    [
        (lambda r: setattr(r, "is_draft_worker", True), "EAGLE / MTP draft models with MLA"),
        (lambda r: setattr(r.token_to_kv_pool, "use_dsa", True), "(DSA)"),
        (lambda r: setattr(r, "token_to_kv_pool", SimpleNamespace(**vars(r.token_to_kv_pool))), "MLA KV pool"),
    ],
)
def test_refused_at_startup(mutate, feature):
    runner = make_runner(16)
    mutate(runner)
    with pytest.raises(UnsupportedFeature) as e:
        make_backend(runner)
    assert str(e.value).startswith("attnplug: backend 'attnplug_triton' does not support") and feature in str(e.value)


def test_provider_without_mla_refused(monkeypatch):
    from attnplug.core.providers import get_provider_cls

    monkeypatch.setattr(get_provider_cls("triton"), "supports_mla", classmethod(lambda cls: False))
    with pytest.raises(
        UnsupportedFeature, match="attnplug: backend 'attnplug_triton' does not support MLA .*with provider 'triton'"
    ):
        make_backend(make_runner(16))


def test_graphs_follow_the_mla_class_graph_support(monkeypatch, caplog):
    """CUDA graphs of MLA configs run on the provider's MLA class: its ``graph_support`` decides the
    refusal, the active line and the graph families' cascade, not the GQA class's (which differs here)."""
    import dataclasses
    import logging

    from attnplug.core.providers import GraphSupport, get_provider_cls

    gqa_cls = get_provider_cls("triton")
    mla_cls = gqa_cls.mla_class()
    assert gqa_cls.graph_support.decode and gqa_cls.graph_support.cascade
    monkeypatch.setenv("ATTNPLUG_CASCADE", "1")
    monkeypatch.delenv("ATTNPLUG_CASCADE_GRAPHS", raising=False)
    monkeypatch.setattr(mla_cls, "graph_support", GraphSupport(False, False, False, "the MLA kernels cannot"))
    be = make_backend(make_runner(16))
    refusal = (
        r"attnplug: backend 'attnplug_triton' does not support CUDA graphs with provider 'triton' "
        r"\(the MLA kernels cannot\); start SGLang with --disable-cuda-graph"
    )
    with pytest.raises(UnsupportedFeature, match=refusal):
        be.check_graph_support()
    with pytest.raises(UnsupportedFeature, match=refusal):
        be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    # graphs without cascade on the MLA class: the active line says so, and capture succeeds (a family
    # asking cascade of a class without it would refuse)
    monkeypatch.setattr(mla_cls, "graph_support", dataclasses.replace(gqa_cls.graph_support, cascade=False))
    with caplog.at_level(logging.INFO):
        be = make_backend(make_runner(16))
    (active,) = [r.getMessage() for r in caplog.records if "attnplug_triton active" in r.getMessage()][-1:]
    assert "in CUDA graphs off" in active
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert be._graphs["decode"].state(be.probe_config).cascade is None


def test_mha_prefill_path_refused_by_name():
    """Without the model's un-absorbed head dims, SGLang's MHA prefill layer (``attn_mha``: H KV heads, head
    dims 48/32) never reaches attnplug once the absorbed dispatch is registered; if it did, it is refused by
    name, never computed wrongly."""
    from sglang.srt.layers.radix_attention import RadixAttention

    runner = make_runner(16)
    reqs = MLARequests(runner, [5], [0])
    fb = reqs.batch(ForwardMode.EXTEND, [5])
    be = make_backend(runner)
    be.init_forward_metadata(fb)
    mha = RadixAttention(H, DN + DR, SCALE, num_kv_heads=H, layer_id=0, v_head_dim=DN)
    with pytest.raises(
        UnsupportedFeature,
        match="attnplug: backend 'attnplug_triton' does not support layer 0's "
        "attention of 4 KV heads, head dims 48/32 on an MLA model .*no ragged prefill",
    ):
        be.forward_extend(
            torch.zeros(5, H * (DN + DR)),
            torch.zeros(5, H, DN + DR),
            torch.zeros(5, H, DN),
            mha,
            fb,
            save_kv_cache=False,
        )


def test_decode_graph_capture_then_replay_matches_reference():
    """A decode batch padded to the captured size: capture (plan into static buffers), then a replay
    with other lengths refreshed in place; the real rows equal the un-absorbed reference."""
    runner = make_runner(16)
    layer = mla_layer(0)
    be = make_backend(runner)
    bs = 4
    be.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    for step, kv in enumerate([[9, 41, 3], [30, 17, 66]]):
        reqs = MLARequests(runner, kv, [k - 1 for k in kv], seed=step)
        fb = reqs.batch(ForwardMode.DECODE, [1, 1, 1])
        pad = bs - 3
        fill = torch.full((pad,), FILL_SEQ_LEN, dtype=torch.int64)
        gfb = SimpleNamespace(
            **{
                **vars(fb),
                **dict(
                    batch_size=bs,
                    num_padding=pad,
                    req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
                    seq_lens=torch.cat([fb.seq_lens, fill]),
                    seq_lens_cpu=torch.cat([fb.seq_lens_cpu, fill]),
                    out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)]),
                ),
            }
        )
        be.init_forward_metadata_out_graph(gfb, in_capture=step == 0)
        q, k, v, m = absorbed_inputs(bs, seed=11 + step)
        out = be.forward_decode(q, k, v, layer, gfb)
        want = unabsorbed_reference(
            runner, reqs, layer, {n: (t[:3] if n.startswith("q") else t) for n, t in m.items()}, [1, 1, 1]
        )
        torch.testing.assert_close(up(out[:3], m), want, atol=2e-4, rtol=1e-3)
    assert be._stats.forwards == {"GRAPH_DECODE": 2}


def mha_layer(layer_id: int = 0):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(H, DN + DR, SCALE, num_kv_heads=H, layer_id=layer_id, v_head_dim=DN)


def mha_inputs(runner, reqs, q_lens, m, layer_id=0):
    """What SGLang's DeepSeek hands ``attn_mha`` in one pass (forward_normal_prepare): ``q [T, H, DN + DR]``
    = cat(q_nope, q_pe); per request, every token of its sequence (request-major) up-projected from the
    pool's latents: ``k = cat(c @ W_UK, k_pe)`` ``[Tk, H, DN + DR]``, ``v = c @ W_UV`` ``[Tk, H, DN]``."""
    buf = runner.token_to_kv_pool.get_key_buffer(layer_id)[:, 0]
    rows = torch.cat(
        [buf[runner.req_to_token_pool.req_to_token[reqs.rows[b], : reqs.kv_lens[b]].long()] for b in range(len(q_lens))]
    )
    c, pe = rows[:, :R], rows[:, R:]
    k = torch.cat([torch.einsum("kr,hrn->khn", c, m["w_uk"]), pe[:, None].expand(-1, H, -1)], -1)
    v = torch.einsum("kr,hrv->khv", c, m["w_uv"])
    return torch.cat([m["q_nope"], m["q_pe"]], -1), k, v


@pytest.mark.parametrize("provider", ["attnplug_triton", "attnplug_fa3"])
def test_mha_prefill_matches_unabsorbed_reference(provider, monkeypatch):
    """With the model's head dims and a provider with a ragged prefill, SGLang's MHA prefill (a fresh prompt and
    two extends on cached prefixes, one pass over the whole sequences as MHA_ONE_SHOT sends them) runs through
    the core: the output equals the un-absorbed reference, the pool is not written, one plan a forward. fa3: its
    logic with the tests' stand-in kernel, which computes this test's float32 and head dims 48/32."""
    if provider == "attnplug_fa3":
        from test_graph_and_draft import _fa3_standin

        from attnplug.core.providers.fa3 import FA3Ragged
        from attnplug.core.providers.fa3_mla import FA3MLAProvider

        _fa3_standin(monkeypatch)
        monkeypatch.setattr(FA3MLAProvider, "mla_refusal", classmethod(lambda cls, config: None))
        monkeypatch.setattr(FA3Ragged, "refusal", classmethod(lambda cls, config: None))
    runner = make_runner(16, mha_dims=True)
    kv, q_lens = [9, 41, 38], [9, 7, 17]
    reqs = MLARequests(runner, kv, [k - q for k, q in zip(kv, q_lens)])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens)
    be = make_backend(runner, name=provider)
    assert be.mha_prefill
    be.init_forward_metadata(fb)
    _, _, _, m = absorbed_inputs(sum(q_lens), seed=5)
    q, k, v = mha_inputs(runner, reqs, q_lens, m)
    pool_before = runner.token_to_kv_pool.get_key_buffer(0).clone()
    ref = unabsorbed_reference(runner, reqs, mla_layer(0), m, q_lens)
    for layer_id in (0, 1):  # the second layer reuses the forward's plan
        out = be.forward_extend(q.reshape(-1, H * (DN + DR)), k, v, mha_layer(layer_id), fb, save_kv_cache=False)
        assert out.shape == (sum(q_lens), H * DN) and not out.isnan().any()
        torch.testing.assert_close(out.view(-1, H, DN).double(), ref, atol=2e-4, rtol=1e-3)
    assert len(be._ragged) == 1 and be._stats.layer_runs == 2
    assert torch.equal(runner.token_to_kv_pool.get_key_buffer(0), pool_before)


def test_mha_prefill_refuses_a_prefix_chunked_pass():
    """K rows that are not the batch's whole sequences (SGLang's prefix-chunked MHA, which attnplug's dispatch
    routes to absorbed MLA) stop the forward by name instead of attending with the wrong mask."""
    runner = make_runner(16, mha_dims=True)
    reqs = MLARequests(runner, [20], [12])
    fb = reqs.batch(ForwardMode.EXTEND, [8])
    be = make_backend(runner)
    be.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="attnplug: backend 'attnplug_triton': the MHA prefill got 8 key rows"):
        be.forward_extend(
            torch.zeros(8, H * (DN + DR)), torch.zeros(8, H, DN + DR), torch.zeros(8, H, DN), mha_layer(), fb
        )


def test_mha_prefill_dispatch_follows_fa3_one_pass_choices(monkeypatch):
    """The registered handler: SGLang's fa3 choice where it is one MHA pass (no cached prefix; a prefix at or
    over the chunked-prefix threshold that fits one shot), absorbed MLA otherwise (a short prefix; a prefix
    too long for one shot, which SGLang would chunk); the absorbed-only registration when the model config
    has no head dims."""
    import sglang.srt.models.deepseek_common.attention_backend_handler as handler_mod
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod as M

    # SGLang's process context, which a server publishes: no deterministic inference, no context parallelism
    exec_cfg = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(handler_mod, "get_exec", lambda: exec_cfg)
    monkeypatch.setattr(handler_mod, "is_cp_active", lambda fb: False, raising=False)
    monkeypatch.setattr(handler_mod, "mla_use_prefill_cp", lambda *a, **k: False, raising=False)
    make_backend(make_runner(16, mha_dims=True), name="attnplug_triton")
    handle = AttentionBackendRegistry.get_handler("attnplug_triton")
    assert handle is not _dispatch_mla_subtype
    attn = SimpleNamespace(
        chunked_prefix_cache_threshold=64,
        disable_chunked_prefix_cache=False,
        flashinfer_mla_disable_ragged=False,
        qk_rope_head_dim=DR,
    )

    def fb(prefix, seq, capacity=1000):
        return SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            extend_prefix_lens_cpu=prefix,
            seq_lens_cpu=torch.tensor(seq),
            get_max_chunk_capacity=lambda: capacity,
            attn_cp_metadata=None,
        )

    assert handle(attn, fb([0, 0], [10, 20])) == M.MHA_ONE_SHOT
    assert handle(attn, fb([0, 70], [10, 90])) == M.MHA_ONE_SHOT
    assert handle(attn, fb([0, 0], [600, 600], capacity=1000)) == M.MHA_CHUNKED_KV  # no prefix: still one pass
    assert handle(attn, fb([0, 10], [10, 20])) == M.MLA  # short prefix: absorbed, as SGLang's fa3
    assert handle(attn, fb([0, 700], [10, 900], capacity=800)) == M.MLA  # SGLang would chunk the prefix
    verify = fb([0], [10])
    verify.forward_mode = ForwardMode.TARGET_VERIFY
    assert handle(attn, verify) == M.MLA
    make_backend(make_runner(16), name="attnplug_triton")
    assert AttentionBackendRegistry.get_handler("attnplug_triton") is _dispatch_mla_subtype


def test_mha_prefill_not_on_an_fp8_latent_pool(caplog):
    """An fp8 latent pool keeps every mode absorbed (SGLang's MHA prefill writes latents unscaled, attnplug's
    write scales them by the layer's k_scale), and the startup log says why."""
    import logging

    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    runner = make_runner(16, mha_dims=True, kv_cache_dtype=torch.float8_e4m3fn)
    runner.token_to_kv_pool = MLATokenToKVPool(
        size=512,
        page_size=16,
        dtype=torch.float8_e4m3fn,
        kv_lora_rank=R,
        qk_rope_head_dim=DR,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    with caplog.at_level(logging.INFO, logger="attnplug.sglang_adapter.mla"):
        be = make_backend(runner)
    assert not be.mha_prefill
    assert "prefill absorbed in every mode (an fp8 latent pool" in caplog.text
