"""Cascade under a custom mask that hides a column of the shared prefix: ``shareable_pages`` caps the
shared part at the first hidden column's page, for every provider (triton, the
reference, flashinfer where it runs), against the float32 reference of the whole batch; fa3, which computes
the prefix without a mask, must refuse the batch (not answer it with the hidden column read)."""

from __future__ import annotations

import math

import fa3_standin
import pytest
import torch
from batches import rel_err

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention, make_plan
from attnplug.core.cascade import shareable_pages
from attnplug.core.config import UnsupportedFeature
from attnplug.core.reference import reference_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, SHARED, Q = 4, 40, 3  # 10 shared pages; 3 draft tokens a request


@pytest.fixture(params=["triton", "reference", "fa3", "flashinfer"])
def provider(request, monkeypatch):
    if request.param == "flashinfer":
        from attnplug.core.providers.base import ProviderUnavailable
        from attnplug.core.providers.flashinfer import FlashInferProvider

        try:
            FlashInferProvider.check_available(torch.device(DEV))
        except ProviderUnavailable as e:
            pytest.skip(f"flashinfer cannot run here: {e}")
    if request.param == "fa3":
        fa3_standin.use_fa3(monkeypatch, DEV)
    return request.param


@pytest.mark.parametrize("hidden", [5, 17, 39])  # a key column inside the shared prefix (page 1, 4, 9)
def test_a_hidden_prefix_column_caps_the_shared_pages(provider, hidden):
    c = AttentionConfig(8, 2, 64, PAGE, torch.bfloat16)
    toks = prompts([(4, SHARED)], 6, seed=hidden)
    batch, q, k, v, n = shared_prefix_batch(c, ForwardMode.TARGET_VERIFY, toks, q_len=Q, seed=hidden, device=DEV)
    # request 2's second draft token may not see key ``hidden`` of the shared prefix
    kv_lens = [
        (int(batch.kv_indptr[b + 1] - batch.kv_indptr[b]) - 1) * PAGE + int(batch.kv_last_page_len[b]) for b in range(4)
    ]
    mask = batch.custom_mask.clone()
    at = sum(Q * kl for kl in kv_lens[:2]) + 1 * kv_lens[2] + hidden
    assert mask[at]
    mask[at] = False
    batch = BatchMetadata(
        batch.mode, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, custom_mask=mask
    )
    whole = make_plan(c, batch, n, device=DEV)
    attn = PagedAttention(c, provider, DEV, cascade="always")
    if provider == "fa3":  # FA3 computes the prefix unmasked: the hidden column must reach its refusal
        with pytest.raises(UnsupportedFeature, match="hides part of the prefix"):
            attn.plan(batch, num_pages=n)
        return
    plan = attn.plan(batch, num_pages=n)
    if hidden >= PAGE:  # a whole page before the hidden column: the others still share
        assert plan.cascade is not None and plan.cascade.shared_tokens > 0
    out = torch.full_like(q, math.nan)
    attn.run(q, k, v, out=out)
    ref, _ = reference_attention(whole, q, k, v)
    assert not torch.isnan(out).any()
    for b in range(4):  # per request: the masked row must not hide in the total
        lo, hi = b * Q, (b + 1) * Q
        assert rel_err(out[lo:hi], ref[lo:hi]) <= 1e-2, (b, rel_err(out[lo:hi], ref[lo:hi]))
    assert shareable_pages(whole)[2] == hidden // PAGE  # the cap itself
