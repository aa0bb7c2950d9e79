"""fp8 KV cache in the vLLM adapter, engine-free (issue 15): what each backend declares and refuses,
and the impl on a vLLM-style uint8 cache - the quantizing KV write with the layer's scales, eager and
graph-buffer forwards against the float32 reference on the dequantized cache, and scale tensors
updated in place between steps (``--calculate-kv-scales`` / checkpoint scales loaded after warm-up)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

Hq, Hkv, D, P, NUM_BLOCKS, DT, SCALE = 4, 2, 32, 4, 48, torch.float32, 0.17
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def env():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return SimpleNamespace(VllmConfig=VllmConfig)


def test_supported_kv_cache_dtypes_per_provider(env):
    from attnplug.vllm_adapter import backend as B

    fp8 = ["fp8", "fp8_e4m3", "fp8_e5m2"]
    assert B.AttnplugTritonBackend.supported_kv_cache_dtypes == ["auto", "float16", "bfloat16", *fp8]
    assert B.AttnplugFlashInferBackend.supported_kv_cache_dtypes == ["auto", "float16", "bfloat16", *fp8]
    assert B.AttnplugFA3Backend.supported_kv_cache_dtypes == ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]


@pytest.mark.parametrize(
    "backend,kvd,refused",
    [
        ("AttnplugTritonBackend", "fp8", None),
        ("AttnplugTritonBackend", "fp8_e5m2", None),
        ("AttnplugFA3Backend", "fp8_e4m3", None),
        ("AttnplugFA3Backend", "fp8_e5m2", "kv_cache_dtype 'fp8_e5m2' with provider 'fa3'"),
        ("AttnplugTritonBackend", "fp8_inc", "kv_cache_dtype 'fp8_inc' with provider 'triton'"),
        (
            "AttnplugFlashInferBackend",
            "int8_per_token_head",
            "kv_cache_dtype 'int8_per_token_head' with provider 'flashinfer'",
        ),
    ],
)
def test_selection_accepts_or_refuses_kv_dtype(env, backend, kvd, refused):
    from attnplug.core import UnsupportedFeature
    from attnplug.vllm_adapter import backend as B

    cls = getattr(B, backend)
    reasons = cls.validate_configuration(head_size=128, dtype=torch.bfloat16, kv_cache_dtype=kvd, block_size=16)
    if refused is None:
        assert reasons == [], reasons
        if cls is B.AttnplugTritonBackend:  # its impl can be built here (the others need a GPU)
            assert cls.get_impl_cls()(Hq, D, SCALE, Hkv, kv_cache_dtype=kvd).fp8_dtype is not None
    else:
        assert len(reasons) == 1 and reasons[0].startswith(f"attnplug {cls.NAME}: unsupported {refused}"), reasons
        with pytest.raises(UnsupportedFeature, match=f"attnplug: backend {cls.NAME} does not support {refused}"):
            cls.get_impl_cls()(Hq, D, SCALE, Hkv, kv_cache_dtype=kvd)


def make(env, name, kvd="fp8"):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.vllm_adapter import backend as B

    cfg = env.VllmConfig()
    cfg.scheduler_config.max_num_seqs = 8
    cfg.model_config = SimpleNamespace(dtype=DT, max_model_len=256)  # the model dtype; the spec's is uint8
    impl = B.AttnplugTritonBackend.get_impl_cls()(Hq, D, SCALE, Hkv, None, None, kvd, None)
    cfg.compilation_config.static_forward_context[name] = SimpleNamespace(impl=impl)
    spec = FullAttentionSpec(block_size=P, num_kv_heads=Hkv, head_size=D, dtype=torch.uint8)
    builder = B.AttnplugTritonBackend.get_builder_cls()(spec, [name], cfg, torch.device("cpu"))
    return impl, builder


def layer_with_scales(k=0.05, v=0.08):
    """What vLLM's Attention layer gives a backend: 0-d float32 scale buffers (and host floats)."""
    return SimpleNamespace(
        _k_scale=torch.tensor(k),
        _v_scale=torch.tensor(v),
        _q_scale=torch.tensor(1.0),
        _k_scale_float=k,
        _v_scale_float=v,
    )


def test_host_scales_are_the_layer_floats_unless_calculated(env, monkeypatch):
    """The impl passes the layer's floats (what vLLM's FLASHINFER reads) as ``host_scales`` next to the
    tensors; with ``--calculate-kv-scales`` (0.26) the first forward changes them after graph capture,
    so then only the tensors go."""
    from attnplug.vllm_adapter import backend as B
    from attnplug.vllm_adapter import compat

    Impl = B.AttnplugTritonBackend.get_impl_cls()
    layer = layer_with_scales(0.05, 0.08)
    sc = Impl(Hq, D, SCALE, Hkv, kv_cache_dtype="fp8").scales(layer)
    assert sc["host_scales"] == (0.05, 0.08) and sc["k_scale"] is layer._k_scale and sc["v_scale"] is layer._v_scale
    assert Impl(Hq, D, SCALE, Hkv).scales(layer) == {}  # a bf16 cache: no scales at all
    monkeypatch.setattr(compat, "calculates_kv_scales", lambda: True)
    sc = Impl(Hq, D, SCALE, Hkv, kv_cache_dtype="fp8").scales(layer)
    assert "host_scales" not in sc and sc["k_scale"] is layer._k_scale


def test_calculates_kv_scales_reads_the_cache_config(env):
    from vllm.config import set_current_vllm_config

    from attnplug.vllm_adapter import compat

    cfg = env.VllmConfig()
    with set_current_vllm_config(cfg):
        assert compat.calculates_kv_scales() is False
        if "calculate_kv_scales" not in type(cfg.cache_config).__dataclass_fields__:
            pytest.skip(f"vLLM {vllm.__version__} has no --calculate-kv-scales (removed after 0.26)")
        cfg.cache_config.calculate_kv_scales = True
        assert compat.calculates_kv_scales() is True


def test_fp8_impl_write_and_forward_against_reference(env):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from attnplug.core import BatchMetadata, ForwardMode, PagedAttention
    from attnplug.core.kv_layout import quantize_fp8
    from attnplug.vllm_adapter import backend as B
    from attnplug.vllm_adapter.compat import split_kv_cache

    impl, builder = make(env, "fp8_unit")
    (cfg,) = builder.attention
    assert cfg.kv_dtype == E4M3 and cfg.dtype == DT
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(NUM_BLOCKS, P, Hkv, 2 * D, dtype=torch.uint8).permute(0, 2, 1, 3)  # vLLM: uint8 bytes
    seq_lens = [13, 6, 21]
    table = torch.zeros(3, 8, dtype=torch.int32)
    perm, used = torch.randperm(NUM_BLOCKS - 1, generator=g) + 1, 0
    slots = []
    for b, s in enumerate(seq_lens):
        n = -(-s // P)
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
        slots += [int(table[b, t // P]) * P + t % P for t in range(s)]
    T = len(slots)
    key = torch.randn(T, Hkv, D, generator=g) * 10  # / 0.05: sigma 200 -> saturates at 448 in places
    value = torch.randn(T, Hkv, D, generator=g) * 3
    layer = layer_with_scales()
    impl.do_kv_cache_update(layer, key, value, kv_cache, torch.tensor(slots))
    kc, vc = split_kv_cache(kv_cache.view(E4M3), D)
    sl = torch.tensor(slots)
    assert torch.equal(kc.reshape(-1, Hkv, D)[sl].float(), quantize_fp8(key, 0.05, E4M3).float())
    assert torch.equal(vc.reshape(-1, Hkv, D)[sl].float(), quantize_fp8(value, 0.08, E4M3).float())
    assert (kc.reshape(-1, Hkv, D)[sl].float().abs() == 448).any()  # saturation happened

    def reference(q, qsl, scales):
        ref = PagedAttention(cfg, "reference", "cpu")
        ref.plan(
            BatchMetadata.from_block_table(ForwardMode.EXTEND, qsl, table, torch.tensor(seq_lens, dtype=torch.int32), P)
        )
        return ref.run(q, kc, vc, k_scale=scales._k_scale, v_scale=scales._v_scale)

    # eager prefill of the whole sequences, then a decode step on the graph buffers (build())
    qsl = torch.tensor([0, 13, 19, 40], dtype=torch.int32)
    q = torch.randn(T, Hq, D, generator=g)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=3,
        num_actual_tokens=T,
        max_query_len=21,
        max_seq_len=21,
        block_table_tensor=table,
        slot_mapping=sl,
    )
    out = torch.full_like(q, float("nan"))
    impl.forward(layer, q, key, value, kv_cache, builder.build(0, cam), out)
    want = reference(q, qsl, layer)
    assert (out - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max())), float((out - want).abs().max())
    unscaled = reference(q, qsl, SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0)))
    assert (out - unscaled).abs().max() > 0.1  # the scales were applied

    # the layer's scale tensors change in place (vLLM 0.26 --calculate-kv-scales; checkpoint scales):
    # a rewrite and a new forward use them without any re-plan or re-build
    layer._k_scale.fill_(0.02)
    layer._v_scale.fill_(0.1)
    impl.do_kv_cache_update(layer, key, value, kv_cache, torch.tensor(slots))
    assert torch.equal(kc.reshape(-1, Hkv, D)[sl].float(), quantize_fp8(key, 0.02, E4M3).float())
    out2 = torch.full_like(q, float("nan"))
    impl.forward(layer, q, key, value, kv_cache, builder.build(0, cam), out2)
    want2 = reference(q, qsl, layer)
    assert (out2 - want2).abs().max() <= 1e-4 * max(1.0, float(want2.abs().max()))

    dq = torch.arange(4, dtype=torch.int32)  # a decode batch in the builder's static (CUDA-graph) buffers
    dcam = CommonAttentionMetadata(
        query_start_loc=dq,
        query_start_loc_cpu=dq.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=3,
        num_actual_tokens=3,
        max_query_len=1,
        max_seq_len=21,
        block_table_tensor=table,
        slot_mapping=sl[torch.tensor([12, 18, 39])],
    )
    md = builder.build_for_cudagraph_capture(dcam)
    assert isinstance(md, B.AttnplugGraphMetadata)
    qd = torch.randn(3, Hq, D, generator=g)
    outd = torch.full_like(qd, float("nan"))
    impl.forward(layer, qd, None, None, kv_cache, md, outd)
    ref = PagedAttention(cfg, "reference", "cpu")
    ref.plan(
        BatchMetadata.from_block_table(ForwardMode.DECODE, dq, table, torch.tensor(seq_lens, dtype=torch.int32), P)
    )
    wantd = ref.run(qd, kc, vc, k_scale=layer._k_scale, v_scale=layer._v_scale)
    assert (outd - wantd).abs().max() <= 1e-4 * max(1.0, float(wantd.abs().max()))
