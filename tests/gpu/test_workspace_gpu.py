"""One FlashInfer workspace per layer config: the eager path, the decode and verify graph families and
the multi-step draft of one config (page 1: the draft's token config is the same config) all run on the
config's one provider instance, forked, so they allocate the library's float workspace once."""

from __future__ import annotations

import pytest
import torch
from gpu_expectations import provider_unavailable

from attnplug.core import AttentionConfig, PagedAttention, ProviderUnavailable
from attnplug.core.cuda_graph import GraphState
from attnplug.core.draft import MultiStepDraftPlanner


def test_one_flashinfer_workspace_per_config():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU here)")
    cfg = AttentionConfig(32, 8, 128, 1, torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    try:
        attn = PagedAttention(cfg, "flashinfer", "cuda")
    except ProviderUnavailable as e:
        provider_unavailable("flashinfer", e)
    first = torch.cuda.memory_allocated() - before
    gd = GraphState(cfg, "flashinfer", max_batch=8, max_tokens=8, max_pages=1024, device="cuda")
    gv = GraphState(
        cfg, "flashinfer", max_batch=8, max_tokens=32, max_pages=1024, device="cuda", mode="verify", num_draft_tokens=4
    )
    draft = MultiStepDraftPlanner(cfg, 2, 3, 8, "flashinfer", "cuda", max_prefix_tokens=1024)
    users = [attn.provider, gd.provider, gv.provider, *draft.providers]
    workspaces = {p._workspace.data_ptr() for p in users}
    assert len(workspaces) == 1, f"{len(workspaces)} FlashInfer workspaces for one config"
    ws = next(iter(users))._workspace
    assert first >= ws.numel()  # the first user allocated it
    # the others added their own small buffers only, far less than one more workspace each
    assert torch.cuda.memory_allocated() - before < first + ws.numel()
