"""SGLang adapter with attention sinks and per-layer sliding windows (gpt-oss): the ``sinks`` argument
SGLang's gpt-oss passes to the backend (``RadixAttention.forward(..., sinks=self.sinks)``) reaches the
core, live, in eager and CUDA-graph forwards; each layer runs its own window; a provider without
sinks is refused by name. Backend-level, on SGLang's real pools, against a float64 dense oracle."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_helpers import HKV, HQ, D, Requests, dense_reference, make_layer, make_runner
from test_graph_and_draft import (
    _dense_step,
    _draft_setup,
    _padded,
    _run_draft_steps,
    _toy_provider,
    make_backend,
    make_draft,
)

from attnplug.core import UnsupportedFeature

pytestmark = pytest.mark.sglang

TOL = dict(atol=2e-5, rtol=2e-5)
WINDOW = 6  # SGLang's sliding_window_size is the core's window_left (gpt-oss: config.sliding_window - 1)


def _layers():
    """gpt-oss-like: layer 0 windowed, layer 1 full; bf16 sinks (SGLang's gpt-oss dtype), float32 model."""
    g = torch.Generator().manual_seed(5)
    layers = [make_layer(0, sliding_window_size=WINDOW), make_layer(1, sliding_window_size=-1)]
    sinks = [(torch.randn(HQ, generator=g) * 4).to(torch.bfloat16) for _ in layers]
    return layers, sinks


def _qkv(t, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, HQ * D, generator=g),
        torch.randn(t, HKV, D, generator=g),
        torch.randn(t, HKV, D, generator=g),
    )


def _check(be, runner, reqs, fb, layers, sinks, q_lens, seed):
    for layer, s in zip(layers, sinks):
        q, k, v = _qkv(int(fb.out_cache_loc.numel()), seed + layer.layer_id)
        out = be.forward(q, k, v, layer, fb, sinks=s)
        wl = layer.sliding_window_size
        want = dense_reference(runner, reqs, layer, q, q_lens, window_left=wl, sinks=s)
        torch.testing.assert_close(out, want, **TOL)
        plain = dense_reference(runner, reqs, layer, q, q_lens, window_left=wl)
        assert not torch.allclose(out, plain, atol=1e-3), "the sinks must matter"


@pytest.mark.parametrize("page_size", [1, 16])
def test_sinks_and_per_layer_windows_extend_then_decode(page_size):
    runner = make_runner(page_size)
    layers, sinks = _layers()
    reqs = Requests(runner, kv_lens=[12, 41, 30], prefix=[0, 32, 20])
    be = make_backend(runner)
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[11, 8, 9], lens=[11, 40, 29])
    reqs.kv_lens = [11, 40, 29]
    be.init_forward_metadata(fb)
    _check(be, runner, reqs, fb, layers, sinks, [11, 8, 9], seed=1)
    reqs.kv_lens = [12, 41, 30]
    fb = reqs.batch(ForwardMode.DECODE, q_lens=[1, 1, 1])
    be.init_forward_metadata(fb)
    _check(be, runner, reqs, fb, layers, sinks, [1, 1, 1], seed=7)
    keys = sorted(be._attn, key=str)
    assert {(k.window_left, k.sinks) for k in be._attn} == {(WINDOW, True), (-1, True)}, keys
    sinks[0].copy_(torch.full((HQ,), 20.0))  # an in-place update (e.g. a weight reload): read at the next run
    _check(be, runner, reqs, fb, layers, sinks, [1, 1, 1], seed=7)


def test_sinks_in_cuda_graph_capture_and_replay():
    """The graph state keys come from the model's layers (a module holding ``sinks`` and its
    ``RadixAttention``); capture and replay run each layer with its window and live sinks."""
    runner = make_runner(4)
    layers, sinks = _layers()
    model = torch.nn.Module()
    for i, (layer, s) in enumerate(zip(layers, sinks)):
        blk = torch.nn.Module()
        blk.sinks, blk.attn = torch.nn.Parameter(s, requires_grad=False), layer
        model.add_module(f"l{i}", blk)
    runner.model = model
    sinks = [m.sinks for m in (model.l0, model.l1)]
    be = make_backend(runner)
    bs = 4
    be.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    assert set(be._graphs["decode"]) == {be.layer_config(layers[0], True), be.layer_config(layers[1], True)}
    for step, kv_lens in enumerate([[22, 36], [10, 41, 18]]):  # capture, then replay
        reqs = Requests(runner, kv_lens=kv_lens, prefix=[k - 1 for k in kv_lens], seed=20 + step)
        fb = reqs.batch(ForwardMode.DECODE, q_lens=[1] * len(kv_lens))
        B = fb.batch_size
        pfb = _padded(fb, bs, 1)
        be.init_forward_metadata_out_graph(pfb, in_capture=step == 0)
        if step == 1:
            sinks[1].data.copy_(torch.full((HQ,), -3.0))  # after capture: the replay reads it
        for layer, s in zip(layers, sinks):
            q, k, v = _qkv(bs, 30 + step + layer.layer_id)
            out = be.forward(q, k, v, layer, pfb, sinks=s)
            want = dense_reference(runner, reqs, layer, q[:B], [1] * B, window_left=layer.sliding_window_size, sinks=s)
            torch.testing.assert_close(out[:B], want, **TOL)
    assert be._stats.forwards.get("GRAPH_DECODE") == 2


def test_provider_without_sinks_refused_naming_attnplug_backend_feature(monkeypatch):
    toy = _toy_provider()
    monkeypatch.setattr(toy.ToyProvider, "supports_sinks", classmethod(lambda cls: False))
    runner = make_runner(1)
    reqs = Requests(runner, kv_lens=[5], prefix=[0])
    fb = reqs.batch(ForwardMode.EXTEND, q_lens=[5])
    be = make_backend(runner, provider=toy.TOY)
    be.init_forward_metadata(fb)
    q, k, v = _qkv(5, 0)
    with pytest.raises(UnsupportedFeature) as e:
        be.forward(q, k, v, make_layer(0), fb, sinks=torch.zeros(HQ))
    msg = str(e.value)
    assert "attnplug" in msg and "'attnplug_triton'" in msg and "attention sinks" in msg and "'toy'" in msg, msg
    assert be.forward(q, k, v, make_layer(0), fb).shape == q.shape  # without sinks the same layer runs


def test_sinks_in_multistep_draft_steps():
    """EAGLE draft steps (``AttnplugMultiStepDraftBackend``: its step backends are this backend's
    subclasses) pass the layer's sinks to the core's draft planner."""
    runner, reqs, fb, draft_slots = _draft_setup(4, 2, 3, seq=[7, 13])
    be = make_draft(runner, 2, 3)
    be.init_forward_metadata(fb)
    layer = make_layer(0)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(2)) * 4
    for i, (q, out) in enumerate(_run_draft_steps(be, fb, draft_slots, layer, seed=1, sinks=sinks)):
        torch.testing.assert_close(out, _dense_step(runner, reqs, layer, draft_slots, i, q, sinks), **TOL)
        assert not torch.allclose(out, _dense_step(runner, reqs, layer, draft_slots, i, q), atol=1e-3)
