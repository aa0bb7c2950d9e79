"""fp8 KV scales as host floats (``host_scales``): the engines fix a layer's k/v scales at load and
their own FlashInfer backends pass them to FlashInfer as floats (no device launch for unit scales).
The flashinfer provider does the same when an adapter hands them over; the other providers keep
reading the tensors. FlashInfer needs CUDA, so its wrapper is a stand-in here that applies the scale
arguments as FlashInfer 0.6.14's ``run`` does (``sm_scale *= k_scale``; ``out *= v_scale`` unless it is
the float 1.0); the real library's numerics are checked on the GPU (``tests/gpu/test_fp8_gpu.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnplug.core import AttentionConfig
from attnplug.core.providers import flashinfer as fip
from attnplug.sglang_adapter import compat as sgl_compat

E4M3 = torch.float8_e4m3fn


class StandInWrapper:
    """``run(q, (k, v), out, lse, return_lse, k_scale=None, v_scale=None)``: ``out = q * k_scale * v_scale``
    (the scales' effect on one key of value 1), recording every call and the launches FlashInfer makes."""

    def __init__(self):
        self.calls, self.launches = [], 0

    def run(self, q, kv, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        self.calls.append(dict(k_scale=k_scale, v_scale=v_scale))
        out.copy_(q * (1.0 if k_scale is None else k_scale))
        self.launches += 1
        if v_scale is not None and not (isinstance(v_scale, float) and v_scale == 1.0):
            out.mul_(v_scale)
            self.launches += 1


def provider_and_plan(cfg, T):
    prov = object.__new__(fip.FlashInferProvider)  # run() reads only the plan's state (no GPU here)
    prov.config, prov.device = cfg, torch.device("cpu")
    w = StandInWrapper()
    plan = SimpleNamespace(state=fip.FlashInferState(w, "decode-tc", prov.q_buffer(T)))
    return prov, plan, w


@pytest.mark.parametrize("k_f, v_f", [(1.0, 1.0), (0.05, 0.08)])
def test_flashinfer_hands_host_scales_to_flashinfer(k_f, v_f):
    cfg = AttentionConfig(4, 2, 32, 16, torch.bfloat16, kv_dtype=E4M3)
    T = 5
    q = torch.randn(T, 4, 32, dtype=torch.bfloat16)
    q_keep = q.clone()
    ks, vs = torch.tensor([k_f]), torch.tensor([v_f])
    prov, plan, w = provider_and_plan(cfg, T)
    host_out = torch.full_like(q, float("nan"))
    prov.run(plan, q, None, None, host_out, **cfg.scale_kwargs(None, ks, vs, None, (k_f, v_f)))
    assert w.calls == [dict(k_scale=k_f, v_scale=v_f)] and all(type(x) is float for x in w.calls[0].values())
    assert w.launches == (1 if v_f == 1.0 else 2)  # unit scales: FlashInfer's kernel alone
    assert torch.equal(q, q_keep)  # the engine's query is not written

    prov, plan, w = provider_and_plan(cfg, T)
    dev_out = torch.full_like(q, float("nan"))
    prov.run(plan, q, None, None, dev_out, **cfg.scale_kwargs(None, ks, vs, None))  # the tensors alone
    assert w.calls == [dict(k_scale=None, v_scale=None)]
    want = q.float() * k_f * v_f
    for out in (host_out, dev_out):
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=1e-2)


def test_host_scales_only_for_quantized_caches():
    unit = torch.ones(1)
    assert AttentionConfig(4, 2, 32, 16, torch.bfloat16).scale_kwargs(unit, host_scales=(0.5, 0.5)) == {}
    kw = AttentionConfig(4, 2, 32, 16, torch.bfloat16, kv_dtype=E4M3).scale_kwargs(unit, host_scales=(1, 2))
    assert kw["host_scales"] == (1.0, 2.0) and all(type(x) is float for x in kw["host_scales"])
    assert "host_scales" not in AttentionConfig(4, 2, 32, 16, torch.bfloat16, kv_dtype=E4M3).scale_kwargs(unit)


@pytest.mark.parametrize(
    "layer, want",
    [
        (
            SimpleNamespace(k_scale=None, v_scale=None, k_scale_float=None, v_scale_float=None),
            (1.0, 1.0),
        ),  # no quant method
        (
            SimpleNamespace(
                k_scale=torch.tensor(0.5), v_scale=torch.tensor(0.25), k_scale_float=0.5, v_scale_float=0.25
            ),
            (0.5, 0.25),
        ),  # checkpoint scales, fixed at load
        (
            SimpleNamespace(
                k_scale=torch.tensor(0.5), v_scale=torch.tensor(0.25), k_scale_float=None, v_scale_float=None
            ),
            None,
        ),  # tensors without floats: the tensors stay the only source
        (SimpleNamespace(), (1.0, 1.0)),  # a layer class without the attributes
    ],
)
def test_sglang_host_scales_of_a_layer(layer, want):
    assert sgl_compat.host_kv_scales(layer) == want
