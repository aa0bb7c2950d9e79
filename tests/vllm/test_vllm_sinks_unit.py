"""Engine-free tests of the vLLM adapter with attention sinks and per-layer sliding windows (gpt-oss):
``supports_sink`` from the provider class, the refusal where a provider has none, the layer's live
``sinks`` Parameter reaching the core in eager and CUDA-graph builds, one core config per window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_vllm_cudagraph_unit import DT, SCALE, Batch, D, Hkv, Hq, P, forward

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def env():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return SimpleNamespace(VllmConfig=VllmConfig, enum=AttentionBackendEnum)


@pytest.fixture
def toy_without_sinks(monkeypatch):
    """The toy fourth provider (tests/toy_provider.py) run by every backend, declared without sinks."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import toy_provider

    toy_provider.register()
    monkeypatch.setenv("ATTNPLUG_PROVIDER_OVERRIDE", toy_provider.TOY)
    monkeypatch.setattr(toy_provider.ToyProvider, "supports_sinks", classmethod(lambda cls: False))
    return toy_provider


SINK_CFG = dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16, has_sink=True)


def _selector(**kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(
        **{**dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16), **kw}
    )


@pytest.mark.parametrize("name", ["AttnplugTritonBackend", "AttnplugFlashInferBackend", "AttnplugFA3Backend"])
def test_supports_sink_is_the_provider_class_capability(env, monkeypatch, name):
    from attnplug.core.providers import get_provider_cls
    from attnplug.vllm_adapter import backend as B

    backend = getattr(B, name)
    cls = get_provider_cls(backend.provider())
    assert backend.supports_sink() is cls.supports_sinks() is True
    monkeypatch.setattr(cls, "supports_sinks", classmethod(lambda c: False))
    assert backend.supports_sink() is False
    assert any("attention sinks" in r for r in backend.validate_configuration(**SINK_CFG))


def test_selection_and_layer_with_sinks_accepted_on_triton(env):
    from vllm.platforms import current_platform

    from attnplug.vllm_adapter.backend import AttnplugTritonBackend

    E = env.enum
    got = current_platform.get_attn_backend_cls(E.ATTNPLUG_TRITON, attn_selector_config=_selector(has_sink=True))
    assert got == E.ATTNPLUG_TRITON.value
    assert AttnplugTritonBackend.validate_configuration(**SINK_CFG) == []
    impl = AttnplugTritonBackend.get_impl_cls()(4, 64, 0.125, 2, sinks=torch.zeros(4))
    assert impl.core_config(16, torch.float32).sinks is True


def test_provider_without_sinks_is_refused_naming_attnplug_backend_feature(env, toy_without_sinks):
    from vllm.platforms import current_platform

    from attnplug.core import UnsupportedFeature
    from attnplug.vllm_adapter.backend import AttnplugTritonBackend

    assert AttnplugTritonBackend.supports_sink() is False
    with pytest.raises(UnsupportedFeature) as e:
        current_platform.get_attn_backend_cls(env.enum.ATTNPLUG_TRITON, attn_selector_config=_selector(has_sink=True))
    with pytest.raises(UnsupportedFeature) as e2:
        AttnplugTritonBackend.get_impl_cls()(4, 64, 0.125, 2, sinks=torch.zeros(4))
    for msg in (str(e.value), str(e2.value)):
        assert "attnplug" in msg and "ATTNPLUG_TRITON" in msg and "attention sinks" in msg and "'toy'" in msg, msg
    impl = AttnplugTritonBackend.get_impl_cls()(4, 64, 0.125, 2)  # the same provider without sinks: accepted
    assert impl.core_config(16, torch.float32).sinks is False


def _reference(b: Batch, impl) -> torch.Tensor:
    """The core's float32 reference provider on the real requests, with the layer's sinks now."""
    from attnplug.core import BatchMetadata, ForwardMode, PagedAttention
    from attnplug.vllm_adapter.compat import split_kv_cache

    n = b.B
    attn = PagedAttention(impl.core_config(P, DT), "reference", "cpu")
    attn.plan(
        BatchMetadata.from_block_table(
            ForwardMode.DECODE, torch.arange(n + 1, dtype=torch.int32), b.block_table[:n], b.seq_lens[:n], P
        )
    )
    k, v = split_kv_cache(b.kv_cache, D)
    return attn.run(b.q[:n].contiguous(), k, v, sinks=impl.sinks.detach().clone())


def test_sinks_parameter_live_and_windows_per_layer_eager_and_graph(env):
    """gpt-oss: layers alternate window and full attention, each with its own ``sinks`` Parameter
    (weights load after the impl is built, in place). Each layer runs its own window and its live
    sinks, in eager and CUDA-graph (capture + replay-time) builds."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.vllm_adapter import backend as B

    cfg = env.VllmConfig()
    cfg.scheduler_config.max_num_seqs = 8
    impls, names = [], []
    for i, window in enumerate([3, None, 3, None]):
        sinks = torch.nn.Parameter(torch.empty(Hq), requires_grad=False)  # as vLLM's GptOssAttention
        impl = B.AttnplugTritonBackend.get_impl_cls()(Hq, D, SCALE, Hkv, None, window, "auto", None, sinks=sinks)
        names.append(f"sinks_l{i}")
        cfg.compilation_config.static_forward_context[names[-1]] = SimpleNamespace(impl=impl)
        impls.append(impl)
    spec = FullAttentionSpec(block_size=P, num_kv_heads=Hkv, head_size=D, dtype=DT)
    builder = B.AttnplugTritonBackend.get_builder_cls()(spec, names, cfg, torch.device("cpu"))
    keys = {impl.core_key for impl in impls}
    assert sorted(k.window_left for k in keys) == [-1, 2] and all(k.sinks for k in keys)
    assert impls[0].core_key == impls[2].core_key != impls[1].core_key and set(builder.attention) == keys
    g = torch.Generator().manual_seed(3)
    for impl in impls:  # the weight load: in place, after the builder
        impl.sinks.data.copy_(torch.randn(Hq, generator=g) * 4)
    impls[0].sinks.data[0] = -float("inf")  # vLLM 0.33+ pads sinks with -inf (a head without a sink)
    b = Batch([9, 14, 6], bs=4)
    eager, graph = builder._build_eager(0, b.cam(b.B)), builder.build_for_cudagraph_capture(b.cam())
    for impl in impls:
        want = _reference(b, impl)
        torch.testing.assert_close(forward(impl, b.kv_cache, eager, b.q)[: b.B], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(forward(impl, b.kv_cache, graph, b.q)[: b.B], want, atol=1e-5, rtol=1e-5)
    windowed, full = _reference(b, impls[0]), _reference(b, impls[1])
    impls[1].sinks.data.copy_(impls[0].sinks.data)
    assert not torch.allclose(_reference(b, impls[1]), windowed, atol=1e-3), "the windows must differ"
    impls[1].sinks.data.copy_(torch.full((Hq,), 30.0))  # an in-place update after capture: seen by the replay
    replay = builder.build(0, b.cam())
    assert isinstance(replay, B.AttnplugGraphMetadata)
    out = forward(impls[1], b.kv_cache, replay, b.q)[: b.B]
    torch.testing.assert_close(out, _reference(b, impls[1]), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, full, atol=1e-3), "the update must matter"
