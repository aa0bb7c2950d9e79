"""Backend-level tests: SGLang's real pools + hand-built ForwardBatch, our backend vs independent oracles.

Oracles: SGLang's own ``TorchNativeAttnBackend`` on the same pools (EXTEND / MIXED / DECODE /
DRAFT_EXTEND_V2 / sliding window) and a float64 dense computation (TARGET_VERIFY masks, soft cap).
"""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang_helpers import HQ, D, Requests, dense_reference, make_layer, make_runner

from attnplug.core import ProviderUnavailable, UnsupportedFeature
from attnplug.sglang_adapter.backend import AttnplugAttnBackend

pytestmark = pytest.mark.sglang

PROVIDERS = ["reference", "triton"]
TOL = dict(atol=2e-5, rtol=2e-5)


def make_backend(runner, name="attnplug_triton", provider=None):
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        return AttnplugAttnBackend(runner, backend_name=name, provider=provider)


def test_page_size_outside_the_core_range_is_refused_at_construction():
    """SGLang accepts --page-size 512; attnplug's kernels take 1..256: refused by name, not a ValueError."""
    runner = make_runner(16)
    runner.page_size = 512
    with pytest.raises(UnsupportedFeature, match=r"attnplug: backend 'attnplug_triton' does not support page size 512"):
        make_backend(runner)


def torch_native(runner):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(runner)


def qkv(fb, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = int(fb.out_cache_loc.numel())
    return (torch.randn(t, HQ * D, generator=g), torch.randn(t, 2, D, generator=g), torch.randn(t, 2, D, generator=g))


def run_both(runner, fb, layers, seed=1, provider="reference"):
    """Our backend, then torch_native on the same pools; returns (ours, theirs) per layer."""
    ours, theirs = make_backend(runner, provider=provider), torch_native(runner)
    ours.init_forward_metadata(fb)
    theirs.init_forward_metadata(fb)
    res = []
    for layer in layers:
        q, k, v = qkv(fb, seed + layer.layer_id)
        a = ours.forward(q, k, v, layer, fb)
        b = theirs.forward(q, k, v, layer, fb)
        res.append((a, b))
    return ours, res


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_then_decode_match_torch_native(provider, page_size):
    runner = make_runner(page_size)
    layers = [make_layer(0), make_layer(1)]
    # 3 requests: fresh prompt, prompt after a cached prefix (radix hit), prefix ending mid-page;
    # each has room for one decoded token.
    reqs = Requests(runner, kv_lens=[8, 41, 38], prefix=[0, 32, 20])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[7, 9, 17], lens=[7, 41 - 1, 37])
    ours, res = run_both(runner, fb, layers, provider=provider)
    assert ours._stats.layer_runs == 2 and ours._stats.max_cached_prefix == 31
    for a, b in res:
        torch.testing.assert_close(a, b, **TOL)
    fb = reqs.batch(ForwardMode.DECODE, q_lens=[1, 1, 1])  # one decode step each
    _, res = run_both(runner, fb, layers, seed=7, provider=provider)
    for a, b in res:
        torch.testing.assert_close(a, b, **TOL)


def test_extend_with_q_padded_to_a_graph_bucket():
    """SGLang's breakable prefill CUDA graphs hand attention q padded to a bucket: rows past the
    batch's tokens are padding -> real rows unchanged, padded rows zero (never stale memory)."""
    runner = make_runner(16)
    layer = make_layer(0)
    reqs = Requests(runner, kv_lens=[8, 41, 38], prefix=[0, 32, 20])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[7, 9, 17], lens=[7, 41 - 1, 37])
    ours = make_backend(runner, provider="triton")
    ours.init_forward_metadata(fb)
    q, k, v = qkv(fb)
    want = ours.forward(q, k, v, layer, fb)  # writes the batch's KV
    pad = torch.full((5, q.shape[1]), float("nan"))
    got = ours.forward(torch.cat([q, pad]), None, None, layer, fb, save_kv_cache=False)
    assert got.shape == (q.shape[0] + 5, q.shape[1])
    torch.testing.assert_close(got[: q.shape[0]], want, atol=0, rtol=0)
    assert torch.equal(got[q.shape[0] :], torch.zeros(5, q.shape[1]))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", ["MIXED", "DRAFT_EXTEND_V2"])
def test_mixed_and_draft_extend_match_torch_native(provider, mode):
    runner = make_runner(1)
    reqs = Requests(runner, kv_lens=[12, 30, 9], prefix=[0, 29, 5])
    fb = reqs.batch(getattr(ForwardMode, mode), q_lens=[12, 1, 4])  # an extend, a decode, a draft window
    _, res = run_both(runner, fb, [make_layer(0)], provider=provider)
    torch.testing.assert_close(res[0][0], res[0][1], **TOL)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_sliding_window_matches_torch_native(provider):
    runner = make_runner(1)
    reqs = Requests(runner, kv_lens=[25, 14], prefix=[10, 0])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[15, 14])
    _, res = run_both(runner, fb, [make_layer(0, sliding_window_size=6)], provider=provider)
    torch.testing.assert_close(res[0][0], res[0][1], **TOL)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify_tree_mask(provider, page_size):
    """TARGET_VERIFY: seq_lens exclude the n draft tokens; custom_mask covers prefix+draft per request."""
    n = 4
    runner = make_runner(page_size)
    reqs = Requests(runner, kv_lens=[20 + n, 33 + n], prefix=[20, 33])
    g = torch.Generator().manual_seed(3)
    masks = []
    for kv in reqs.kv_lens:
        tree = torch.tril(torch.rand(n, n, generator=g) < 0.6) | torch.eye(n, dtype=torch.bool)
        tree[:, 0] = True  # every draft token descends from the root
        masks.append(torch.cat([torch.ones(n, kv - n, dtype=torch.bool), tree], 1))
    flat = torch.cat([m.reshape(-1) for m in masks] + [torch.ones(11, dtype=torch.bool)])  # padded, like SGLang
    spec = SimpleNamespace(custom_mask=flat, draft_token_num=n, num_tokens_per_req=-1, kv_indptr=None)
    fb = reqs.batch(ForwardMode.TARGET_VERIFY, q_lens=[n, n], spec_info=spec)
    layer = make_layer(0)
    be = make_backend(runner, provider=provider)
    be.init_forward_metadata(fb)
    q, k, v = qkv(fb)
    out = be.forward(q, k, v, layer, fb)
    torch.testing.assert_close(out, dense_reference(runner, reqs, layer, q, [n, n], masks=masks), **TOL)
    # the mask matters: a plain causal chain differs on this tree
    assert not torch.allclose(out, dense_reference(runner, reqs, layer, q, [n, n]), **TOL)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_logit_cap_is_passed_to_the_core(provider):
    runner = make_runner(1)
    reqs = Requests(runner, kv_lens=[21, 9], prefix=[13, 0])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[8, 9])
    layer = make_layer(0, logit_cap=0.5)
    be = make_backend(runner, provider=provider)
    be.init_forward_metadata(fb)
    q, k, v = qkv(fb)
    q = q * 8  # large logits so the cap bites
    out = be.forward(q, k, v, layer, fb)
    torch.testing.assert_close(out, dense_reference(runner, reqs, layer, q, [8, 9], cap=0.5), **TOL)
    assert not torch.allclose(out, dense_reference(runner, reqs, layer, q, [8, 9]), **TOL)


def test_plan_once_per_forward_run_per_layer(monkeypatch):
    from attnplug.core import PagedAttention

    calls = {"plan": 0, "run": 0}
    for name in calls:
        orig = getattr(PagedAttention, name)

        def spy(self, *a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(PagedAttention, name, spy)
    runner = make_runner(1, layers=3)
    reqs = Requests(runner, kv_lens=[10, 5], prefix=[4, 0])
    be = make_backend(runner, provider="reference")
    for _step in range(2):
        fb = reqs.batch(ForwardMode.EXTEND, q_lens=[6, 5])
        be.init_forward_metadata(fb)
        for lid in range(3):
            be.forward(*qkv(fb), make_layer(lid), fb)
    assert calls == {"plan": 2, "run": 6}


# -- refusals: named attnplug + backend + feature ------------------------------------------------------
def _fp8(r):  # fp8_e4m3 / e5m2 pools are read (tests/sglang/test_fp8_sglang.py); ROCm's fnuz is not
    r.kv_cache_dtype = torch.float8_e4m3fnuz


def _mla(r):
    from sglang.srt.configs.model_config import AttentionArch

    r.model_config.attention_arch = AttentionArch.MLA


@pytest.mark.parametrize(
    "mutate, feature",
    [
        (lambda r: setattr(r.model_config, "is_encoder_decoder", True), "encoder-decoder"),
        (_mla, "MLA"),
        (_fp8, "float8_e4m3fnuz"),
        (lambda r: setattr(r, "kv_index_translator", SimpleNamespace(reads_are_translated=True)), "translated"),
        (lambda r: setattr(r, "token_to_kv_pool", SimpleNamespace(**vars(r.token_to_kv_pool))), "KV pool"),
    ],
)
def test_unsupported_model_refused_at_startup(mutate, feature):
    runner = make_runner(1)
    mutate(runner)
    with pytest.raises(UnsupportedFeature, match=rf"attnplug: backend 'attnplug_triton' does not support .*{feature}"):
        make_backend(runner, provider="reference")


@pytest.mark.parametrize(
    "layer_over, kwargs, feature",
    [
        (dict(is_cross_attention=True), {}, "cross attention"),
        (dict(attn_type="encoder_only"), {}, "non-causal"),
        (dict(logit_cap=5.0, logit_capping_method="soft"), {}, "logit capping method"),
        ({}, dict(score_mod=lambda s: s), "score_mod"),
        ({}, dict(sinks=torch.zeros(HQ + 1)), "sinks of shape"),
    ],
)
def test_unsupported_layer_refused(layer_over, kwargs, feature):
    from sglang.srt.layers.radix_attention import AttentionType

    if layer_over.get("attn_type") == "encoder_only":
        layer_over = dict(attn_type=AttentionType.ENCODER_ONLY)
    runner = make_runner(1)
    reqs = Requests(runner, kv_lens=[5], prefix=[0])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[5])
    be = make_backend(runner, provider="reference")
    be.init_forward_metadata(fb)
    with pytest.raises(UnsupportedFeature, match=rf"attnplug: backend 'attnplug_triton' .*{feature}"):
        be.forward(*qkv(fb), make_layer(0, **layer_over), fb, **kwargs)


def test_multistep_draft_decode_refused():
    runner = make_runner(1)
    reqs = Requests(runner, kv_lens=[5], prefix=[4])
    fb = reqs.batch(ForwardMode.DECODE, q_lens=[1], spec_info=SimpleNamespace(kv_indptr=torch.zeros(2)))
    be = make_backend(runner, provider="reference")
    with pytest.raises(UnsupportedFeature, match="attnplug_triton.*multi-step draft"):
        be.init_forward_metadata(fb)


@pytest.mark.parametrize(
    "name, hint", [("attnplug_flashinfer", "flashinfer-python"), ("attnplug_fa3", "FlashAttention-3")]
)
def test_gpu_backends_refused_on_cpu_with_install_hint(name, hint):
    with pytest.raises(ProviderUnavailable, match=rf"attnplug: backend '{name}' cannot start.*To install: .*{hint}"):
        make_backend(make_runner(1), name=name)


def test_cuda_graph_seams():
    """Graph methods without graph state: the out-of-graph half is the eager metadata step; capture
    needs init_cuda_graph_state (graph behaviour itself: test_graph_and_draft.py)."""
    runner = make_runner(1)
    be = make_backend(runner, provider="reference")
    assert be.get_cuda_graph_seq_len_fill_value() == 1
    with pytest.raises(
        UnsupportedFeature, match="attnplug_triton.*CUDA graphs with provider 'reference'.*disable-cuda-graph"
    ):
        be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    reqs = Requests(runner, kv_lens=[6], prefix=[5])
    fb = reqs.batch(ForwardMode.DECODE, q_lens=[1])
    with pytest.raises(UnsupportedFeature, match="CUDA-graph capture without init_cuda_graph_state"):
        be.init_forward_metadata_out_graph(fb, in_capture=True)
    be.init_forward_metadata_out_graph(fb)  # eager use of the out-of-graph half plans the forward
    be.init_forward_metadata_in_graph(fb)
    q, k, v = qkv(fb)
    theirs = torch_native(runner)
    theirs.init_forward_metadata(fb)
    torch.testing.assert_close(
        be.forward(q, k, v, make_layer(0), fb), theirs.forward(q, k, v, make_layer(0), fb), **TOL
    )


def test_log_line_and_marker(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ATTNPLUG_MARKER_DIR", str(tmp_path))
    runner = make_runner(16)
    with caplog.at_level(logging.INFO, logger="attnplug.sglang_adapter.backend"):
        be = make_backend(runner)
    assert (
        "attnplug: attnplug_triton active (provider triton, page 16, layout NHD, dtype float32, heads 4/2"
        in caplog.text
    )
    reqs = Requests(runner, kv_lens=[9], prefix=[3])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[6])
    be.init_forward_metadata(fb)
    be.forward(*qkv(fb), make_layer(0), fb)
    be.init_forward_metadata(reqs.batch(ForwardMode.EXTEND, q_lens=[6]))  # marker is rewritten per forward
    (marker,) = tmp_path.glob("sglang-*.json")
    data = json.loads(marker.read_text())
    assert data["backend"] == "attnplug_triton" and data["provider"] == "triton" and data["page_size"] == 16
    assert data["forwards"] == {"EXTEND": 2} and data["layer_runs"] == 1 and data["max_cached_prefix"] == 3


def test_triton_on_cpu_without_interpreter_refused(monkeypatch):
    import attnplug.core.providers.triton as tp

    monkeypatch.delenv("TRITON_INTERPRET")
    make_backend(make_runner(1))  # the provider prepares the process: the variable is set again ...
    assert os.environ["TRITON_INTERPRET"] == "1"
    monkeypatch.setattr(tp, "triton_interpreter_active", lambda: False)  # ... too late once triton is compiled
    with pytest.raises(
        ProviderUnavailable, match="attnplug_triton.*provider 'triton'.*Triton interpreter.*TRITON_INTERPRET=1"
    ):
        make_backend(make_runner(1))
