"""Issue 42 (SGLang, CPU pins): SGLang's own decision whether it captures the EAGLE draft steps in CUDA
graphs with each attnplug backend. SGLang's ``EagleDraftWorker._capture_cuda_graphs`` (0.5.17 and
0.5.23) runs here on a stand-in worker, as on a CUDA machine (``_is_cpu`` off, ``_is_cuda`` on), with the
draft backends SGLang's ``DraftBackendFactory`` builds through attnplug's hook; the graph-runner classes
are recorders (constructing them is the capture). Draft decode is captured for every backend with more
than one step; draft extend only for the backend types SGLang lists: attnplug's draft-extend backend
must be one for every provider, or draft extend runs eagerly. Target verify has no backend check in
either release (the decode graph runner captures ``TARGET_VERIFY`` whenever speculation is on); what
the backend must do there is pinned in ``test_graph_and_draft.py``
(``test_every_provider_declares_sglang_verify_and_draft_graphs``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from sglang.srt.runtime_context import get_parallel
from test_graph_and_draft import _draft_runner, _fa3_standin, _factory, hooked_factory  # noqa: F401

pytestmark = pytest.mark.sglang

TOPK, STEPS, DRAFT_TOKENS = 4, 3, 8  # the EAGLE setting (topk 4, 3 steps)


def _capture(monkeypatch, decode, extend):
    """Run SGLang's ``EagleDraftWorker._capture_cuda_graphs`` for these draft backends; returns which
    graph runners it built: ``{"draft_decode": backend, "draft_extend": backend}``."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    built = {}
    for mod, cls in (("flashmla_backend", "FlashMLABackend"), ("flashattention_backend", "FlashAttentionBackend")):
        try:  # CUDA-only backends SGLang lists under _is_cuda (0.5.23); stand-ins where their kernels are absent
            __import__(f"sglang.srt.layers.attention.{mod}")
        except ImportError:
            monkeypatch.setitem(
                sys.modules, f"sglang.srt.layers.attention.{mod}", SimpleNamespace(**{cls: type(cls, (), {})})
            )
    for name, value in dict(
        _is_cpu=False, _is_cuda=True, _is_hip=False, _is_npu=False, _is_xpu=False, _is_musa=False
    ).items():
        monkeypatch.setattr(ew, name, value, raising=False)
    monkeypatch.setattr(ew, "check_cuda_graph_backend", lambda *a, **k: False)
    monkeypatch.setattr(ew, "get_model", lambda: SimpleNamespace(model_impl="sglang"), raising=False)
    cfg = SimpleNamespace(
        graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")))
    )
    monkeypatch.setattr(ew, "get_exec", lambda: cfg, raising=False)
    monkeypatch.setattr(ew, "get_batch_sizes_to_capture", lambda *a, **k: ([1, 2, 4], [1, 2, 4]))
    monkeypatch.setattr(ew, "get_available_gpu_memory", lambda *a, **k: 0.0)
    monkeypatch.setattr(
        ew, "EAGLEDraftCudaGraphRunner", lambda w: built.setdefault("draft_decode", w.draft_attn_backend)
    )
    monkeypatch.setattr(
        ew, "EAGLEDraftExtendCudaGraphRunner", lambda w: built.setdefault("draft_extend", w.draft_extend_attn_backend)
    )
    worker = SimpleNamespace(
        speculative_num_steps=STEPS,
        topk=TOPK,
        speculative_num_draft_tokens=DRAFT_TOKENS,
        device="cuda",
        gpu_id=0,
        target_worker=SimpleNamespace(device="cuda"),
        draft_runner=decode.draft_runner if hasattr(decode, "draft_runner") else None,
        draft_attn_backend=decode,
        draft_extend_attn_backend=extend,
        speculative_algorithm=SimpleNamespace(name="EAGLE"),
        _specialized_graph_memory_usage={},
        _specialized_graph_time_usage={},
    )
    ew.EagleDraftWorker._capture_cuda_graphs(worker)
    return built


@pytest.mark.parametrize("provider", ["triton", "fa3", "flashinfer"])
def test_sglang_captures_draft_decode_and_draft_extend(provider, monkeypatch, hooked_factory):  # noqa: F811
    from attnplug.sglang_adapter.draft import AttnplugDraftExtendBackend, AttnplugMultiStepDraftBackend

    if provider == "fa3":
        _fa3_standin(monkeypatch)
    if provider == "flashinfer":  # its kernels need CUDA: the factory picks the classes, built empty here
        for cls in (AttnplugDraftExtendBackend, AttnplugMultiStepDraftBackend):
            monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: setattr(self, "attn_backends", []))
    name = f"attnplug_{provider}"
    monkeypatch.setattr(
        hooked_factory, "get_spec", lambda: SimpleNamespace(speculative_attention_mode="prefill"), raising=False
    )  # SGLang's default mode: draft extend on the prefill backend
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        decode = _factory(_draft_runner(), name, TOPK, STEPS).create_decode_backend()
        extend = _factory(_draft_runner(), name, TOPK, STEPS).create_draft_extend_backend()
    assert type(decode) is AttnplugMultiStepDraftBackend and type(extend) is AttnplugDraftExtendBackend, provider
    built = _capture(monkeypatch, decode, extend)
    assert built == {"draft_decode": decode, "draft_extend": extend}, (provider, built)


def test_sglang_runs_draft_extend_eagerly_for_a_backend_it_does_not_list(monkeypatch, hooked_factory):  # noqa: F811
    """The same decision with attnplug's plain backend as the draft-extend backend (what attnplug builds
    for a provider without chain-verify graphs): SGLang captures draft decode only."""
    from attnplug.sglang_adapter.backend import AttnplugAttnBackend

    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
        decode = _factory(_draft_runner(), "attnplug_triton", TOPK, STEPS).create_decode_backend()
        plain = AttnplugAttnBackend(_draft_runner(), backend_name="attnplug_triton")
    assert set(_capture(monkeypatch, decode, plain)) == {"draft_decode"}


@pytest.mark.parametrize("provider", ["triton", "fa3"])
def test_ngram_target_verify_graph_state_on_sglangs_capture_width(provider, monkeypatch):
    """n-gram speculation (SGLang's ``NGRAM``, both releases): SGLang's decode graph runner captures
    ``TARGET_VERIFY`` whenever the algorithm is speculative, ``decode_num_tokens_per_req`` (SGLang's
    ``ModelRunner`` method, run on the stand-in runner) tokens a request, and sizes the backend with
    ``init_cuda_graph_state(max_bs, max_bs * width)``: attnplug builds tree-mask verify graph states of
    that width next to its decode ones (a refusal here would stop SGLang's start; there is no eager
    fall-back). Without speculation the same runner asks one token a request: decode states only."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_helpers import make_runner
    from test_graph_and_draft import make_backend

    if provider == "fa3":
        _fa3_standin(monkeypatch)
    from sglang.srt.speculative import spec_utils

    spec = SimpleNamespace(speculative_num_draft_tokens=DRAFT_TOKENS, speculative_eagle_topk=None)
    monkeypatch.setattr(spec_utils, "get_spec", lambda: spec, raising=False)  # 0.5.23 reads the published bag
    for algo, want in (("NGRAM", DRAFT_TOKENS), (None, 1)):
        server_args = SimpleNamespace(
            speculative_num_draft_tokens=DRAFT_TOKENS,
            speculative_algorithm=algo,
            speculative_eagle_topk=None,
            speculative_num_steps=None,
            dllm_algorithm=None,
        )
        runner = make_runner(4, spec_algorithm=SpeculativeAlgorithm.from_string(algo), server_args=server_args)
        width = ModelRunner.decode_num_tokens_per_req(runner, num_draft_tokens=DRAFT_TOKENS if algo else None)
        assert width == want, (algo, width)
        be = make_backend(runner, provider, f"attnplug_{provider}")
        be.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * width)
        assert be._graphs["decode"], provider
        verify = be._graphs["verify"]
        assert bool(verify) is (algo is not None), (algo, verify)
        assert all(gs.q == width and not gs.chain for gs in verify.values())
