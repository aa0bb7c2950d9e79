"""Engine-free tests of the vLLM adapter: Builder.build + Impl.do_kv_cache_update/forward on a
hand-made CommonAttentionMetadata vs a dense attention oracle; registration, pickling and refusals."""

from __future__ import annotations

import math
import pickle
import subprocess
from types import SimpleNamespace

import pytest
import torch
from vllm_test_helpers import VENV_PYTHON, subprocess_env

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vllm_env():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # runs attnplug's register() through its entry point
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return SimpleNamespace(config=VllmConfig(), enum=AttentionBackendEnum)


def dense_attention(q, k, v, q_len, scale, window_left=-1, soft_cap=0.0):
    """Oracle: ``q [q_len, Hq, D]`` are the last positions of the sequence ``k/v [L, Hkv, D]``."""
    L, g = k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    pos = torch.arange(L - q_len, L)[:, None]
    key = torch.arange(L)[None, :]
    ok = key <= pos
    if window_left >= 0:
        ok &= key >= pos - window_left
    s = s.masked_fill(~ok[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("physical", ["NHD", "HND"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (9, 30.0)])
def test_build_and_forward_match_dense_oracle(vllm_env, physical, window, soft_cap):
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.vllm_adapter import backend as B

    torch.manual_seed(0)
    Hq, Hkv, D, P, num_blocks, dt = 4, 2, 64, 16, 40, torch.float32
    impl = B.AttnplugTritonBackend.get_impl_cls()(Hq, D, 0.11, Hkv, None, window, "auto", soft_cap)
    name = f"l_{physical}_{window}"
    vllm_env.config.compilation_config.static_forward_context[name] = SimpleNamespace(impl=impl)
    spec = FullAttentionSpec(block_size=P, num_kv_heads=Hkv, head_size=D, dtype=dt)
    builder = B.AttnplugTritonBackend.get_builder_cls()(spec, [name], vllm_env.config, torch.device("cpu"))
    # vLLM's logical view [blocks, Hkv, P, 2D] over either physical layout.
    if physical == "NHD":
        kv_cache = torch.zeros(num_blocks, P, Hkv, 2 * D, dtype=dt).permute(0, 2, 1, 3)
    else:
        kv_cache = torch.zeros(num_blocks, Hkv, P, 2 * D, dtype=dt)
    # requests: (cached prefix, new tokens): prefill, extend on a prefix, decode, one-token prefill
    reqs = [(0, 37), (40, 5), (70, 1), (0, 1)]
    pages = torch.randperm(num_blocks)
    max_pages = 6
    block_table = torch.full((len(reqs), max_pages), 10_000, dtype=torch.int32)
    full_k, full_v, used = [], [], 0
    for b, (pre, new) in enumerate(reqs):
        n_pages = -(-(pre + new) // P)
        block_table[b, :n_pages] = pages[used : used + n_pages].to(torch.int32)
        used += n_pages
        full_k.append(torch.randn(pre + new, Hkv, D, dtype=dt))
        full_v.append(torch.randn(pre + new, Hkv, D, dtype=dt))

    def slots(b, lo, hi):
        pos = torch.arange(lo, hi)
        return block_table[b, pos // P].long() * P + pos % P

    # cached prefixes, written by hand in vLLM's convention: kv_cache[block, :, offset] = K ++ V
    for b, (pre, _new) in enumerate(reqs):
        s = slots(b, 0, pre)
        kv_cache[s // P, :, s % P] = torch.cat([full_k[b][:pre], full_v[b][:pre]], -1)
    # this forward: new tokens of every request + 3 padding tokens
    pad = 3
    q_lens = [new for _, new in reqs]
    T = sum(q_lens)
    q = torch.randn(T + pad, Hq, D, dtype=dt)
    k = torch.cat([full_k[b][pre:] for b, (pre, _) in enumerate(reqs)] + [torch.randn(pad, Hkv, D)])
    v = torch.cat([full_v[b][pre:] for b, (pre, _) in enumerate(reqs)] + [torch.randn(pad, Hkv, D)])
    new_slots = [slots(b, pre, pre + new) for b, (pre, new) in enumerate(reqs)]
    slot_mapping = torch.cat(new_slots + [torch.full((pad,), -1)])
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([pre + new for pre, new in reqs], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=len(reqs),
        num_actual_tokens=T + pad,
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
    )
    impl.do_kv_cache_update(None, k, v, kv_cache, slot_mapping)
    s = slot_mapping[:T]
    torch.testing.assert_close(kv_cache[s // P, :, s % P], torch.cat([k[:T], v[:T]], -1), rtol=0, atol=0)
    md = builder.build(0, cam)
    out = torch.full((T + pad, Hq, D), 7.0, dtype=dt)
    assert impl.forward(None, q, k, v, kv_cache, md, out) is out
    for b, (_pre, new) in enumerate(reqs):
        lo = int(qsl[b])
        wl = window - 1 if window else -1  # vLLM's sliding_window counts the query itself
        want = dense_attention(q[lo : lo + new], full_k[b], full_v[b], new, 0.11, wl, soft_cap or 0.0)
        torch.testing.assert_close(out[lo : lo + new].double(), want, atol=2e-5, rtol=1e-4)
    assert bool((out[T:] == 7.0).all()), "padding rows must be left alone"
    assert B.STATS["prefix_hit_requests"] >= 1  # request 1 extends 5 tokens on a 40-token prefix


def test_builder_takes_v2_runner_kwargs_and_refuses_unknown_values(vllm_env):
    """vLLM's V2 runner constructs builders as ``builder_cls(spec, layers, config, device,
    **builder_kwargs)`` and calls ``build(0, cam, **kwargs)`` (both ``{}`` for attention layers): the
    empty forms bind; a value attnplug does not know refuses, naming attnplug and the backend."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attnplug.core import UnsupportedFeature
    from attnplug.vllm_adapter import backend as B

    Hq, Hkv, D, P = 4, 2, 64, 16
    impl = B.AttnplugTritonBackend.get_impl_cls()(Hq, D, 0.125, Hkv, None, None, "auto", None)
    vllm_env.config.compilation_config.static_forward_context["l_kw"] = SimpleNamespace(impl=impl)
    spec = FullAttentionSpec(block_size=P, num_kv_heads=Hkv, head_size=D, dtype=torch.float32)
    cls = B.AttnplugTritonBackend.get_builder_cls()
    builder = cls(spec, ["l_kw"], vllm_env.config, torch.device("cpu"), **{})
    with pytest.raises(
        UnsupportedFeature,
        match="attnplug: backend ATTNPLUG_TRITON does not support "
        r"metadata-builder options \['block_table_width'\]",
    ):
        cls(spec, ["l_kw"], vllm_env.config, torch.device("cpu"), block_table_width=128)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq = torch.tensor([5], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        num_reqs=1,
        num_actual_tokens=1,
        max_query_len=1,
        max_seq_len=5,
        block_table_tensor=torch.zeros(1, 2, dtype=torch.int32),
        slot_mapping=torch.tensor([4]),
    )
    assert builder.build(0, cam, **{}) is not None
    with pytest.raises(UnsupportedFeature, match=r"metadata-builder build\(\) options \['mamba_state'\]"):
        builder.build(0, cam, mamba_state=object())


def test_registration_names_and_cli_parsing(vllm_env):
    from vllm.config.attention import AttentionConfig

    E = vllm_env.enum
    for name in ("ATTNPLUG_TRITON", "ATTNPLUG_FLASHINFER", "ATTNPLUG_FA3"):
        assert AttentionConfig(backend=name.lower()).backend is E[name]
        cls = E[name].get_class()
        assert cls.get_name() == name and E[cls.get_name()] is E[name]
    assert E.CUSTOM.value is None and not E.CPU_ATTN.is_overridden()  # no slot taken, nothing overridden


def test_cli_flags_accept_attnplug_names(vllm_env):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from attnplug.vllm_adapter.compat import selected_names

    E = vllm_env.enum
    p = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert p.parse_args(["--attention-backend", "attnplug_triton"]).attention_backend == "attnplug_triton"
    ac = p.parse_args(["--attention-config", '{"backend": "attnplug_fa3"}']).attention_config
    assert ac.backend is E.ATTNPLUG_FA3
    assert p.parse_args(["-ac.backend=Attnplug_FlashInfer"]).attention_config.backend is E.ATTNPLUG_FLASHINFER
    per_kind = p.parse_args(["-ac", '{"backend_per_kind": {"full_attention": "attnplug_triton"}}']).attention_config
    assert selected_names(SimpleNamespace(attention_config=per_kind)) == {"ATTNPLUG_TRITON"}
    assert selected_names(SimpleNamespace(attention_config=p.parse_args([]).attention_config)) == set()


def test_member_unpickles_in_fresh_process_before_plugins(vllm_env):
    """A spawned child unpickles the config before load_general_plugins(): the member must survive."""
    blob = pickle.dumps({"backend": vllm_env.enum.ATTNPLUG_TRITON})
    code = (
        "import pickle,sys\n"
        "import vllm.plugins as p\n"
        "assert not p.plugins_loaded\n"
        "d = pickle.loads(sys.stdin.buffer.read())\n"
        "print(d['backend'].name, d['backend'].get_path())\n"
    )
    r = subprocess.run([VENV_PYTHON, "-c", code], input=blob, capture_output=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stdout.decode().split()[-2:] == ["ATTNPLUG_TRITON", "attnplug.vllm_adapter.backend.AttnplugTritonBackend"]


def test_register_is_light_and_survives_broken_kernel_libs():
    """register() (through vLLM's plugin loader) imports no provider / kernel library and only
    creates the members (of the core, only its light registry); broken triton / flashinfer / FA3
    installs do not matter to it."""
    from vllm_test_helpers import BROKEN_LIBS, REPO

    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "heavy = [m for m in sys.modules if m.startswith(('attnplug.core', 'attnplug.vllm_adapter.backend', "
        "'flashinfer', 'flash_attn')) and m not in ('attnplug.core', 'attnplug.core.registry')]\n"
        "print('RESULT', E.ATTNPLUG_FA3.name, heavy)\n"
    )
    env = subprocess_env(PYTHONPATH=f"{BROKEN_LIBS}:{REPO}")
    r = subprocess.run([VENV_PYTHON, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT ATTNPLUG_FA3 []" in r.stdout, r.stdout + r.stderr[-3000:]


def _selector(**kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16)
    return AttentionSelectorConfig(**{**base, **kw})


def test_cpu_platform_override_only_for_attnplug(vllm_env):
    from vllm.platforms import current_platform

    E = vllm_env.enum
    get = current_platform.get_attn_backend_cls
    assert get(E.ATTNPLUG_TRITON, attn_selector_config=_selector(), num_heads=4) == E.ATTNPLUG_TRITON.value
    cpu = E.CPU_ATTN.get_path()
    for other in (None, E.CPU_ATTN, E.FLASH_ATTN, E.CUSTOM):
        assert get(other, attn_selector_config=_selector(), num_heads=4) == cpu


@pytest.mark.parametrize(
    "kw,feature",
    [
        (dict(kv_cache_dtype="fp8_inc"), "kv_cache_dtype 'fp8_inc' with provider 'triton'"),  # fp8 itself: read
        (dict(kv_cache_dtype="float16"), "kv_cache_dtype 'float16' with model dtype"),
        (dict(use_mla=True), "MLA"),
        (dict(attn_type="encoder_only"), "attention type 'encoder_only'"),
        (dict(use_non_causal=True), "non-causal"),
        (dict(block_size=512), "block_size 512"),
    ],
)
def test_cpu_selection_refuses_unsupported_features(vllm_env, kw, feature):
    from vllm.platforms import current_platform

    from attnplug.core import UnsupportedFeature

    with pytest.raises(UnsupportedFeature) as e:
        current_platform.get_attn_backend_cls(vllm_env.enum.ATTNPLUG_TRITON, attn_selector_config=_selector(**kw))
    assert "attnplug" in str(e.value) and "ATTNPLUG_TRITON" in str(e.value) and feature in str(e.value)


@pytest.mark.parametrize(
    "kw,feature",
    [
        (dict(attn_type="encoder_only"), "encoder_only"),
        (dict(attn_type="encoder_decoder"), "encoder_decoder"),
        (dict(attn_type="encoder"), "'encoder'"),
        (dict(kv_cache_dtype="fp8_inc"), "fp8_inc"),
        (dict(alibi_slopes=[0.5] * 4), "ALiBi"),
        (dict(sinks=torch.zeros(4, 4)), "sinks"),
    ],
)
def test_impl_refuses_unsupported_layers(vllm_env, kw, feature):
    from attnplug.core import UnsupportedFeature
    from attnplug.vllm_adapter.backend import AttnplugTritonBackend

    with pytest.raises(UnsupportedFeature) as e:
        AttnplugTritonBackend.get_impl_cls()(4, 64, 0.125, 2, **kw)
    assert "attnplug" in str(e.value) and "ATTNPLUG_TRITON" in str(e.value) and feature in str(e.value)


@pytest.mark.parametrize(
    "name,hint",
    [
        ("ATTNPLUG_FLASHINFER", "pip install flashinfer-python (attnplug's [flashinfer] extra"),
        ("ATTNPLUG_FA3", "flash-attention"),
    ],
)
def test_gpu_only_backends_refuse_cpu_with_install_hint(vllm_env, monkeypatch, name, hint):
    from vllm.platforms import current_platform

    from attnplug.core import ProviderUnavailable

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    with pytest.raises(ProviderUnavailable) as e:
        current_platform.get_attn_backend_cls(vllm_env.enum[name], attn_selector_config=_selector())
    msg = str(e.value)
    assert "attnplug" in msg and name in msg and hint in msg, msg


def test_register_never_raises(monkeypatch):
    import attnplug.vllm_adapter as adapter
    from attnplug.vllm_adapter import compat

    def boom(*a, **k):
        raise RuntimeError("simulated broken vLLM internals")

    monkeypatch.setattr(compat, "register_backends", boom)
    adapter.register()  # logs, does not raise
