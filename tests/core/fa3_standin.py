"""A stand-in for vLLM's FA3 varlen call (``flash_attn_varlen_func(..., fa_version=3)``), so the
fa3 provider's own logic (block tables, tree-verify split, fp8 descales, cascade inside graphs) runs
on CPU under the Triton interpreter; the real kernel runs in the same tests on an H200."""

from __future__ import annotations

import math

import pytest
import torch
from batches import fresh_provider_instances

E4M3 = torch.float8_e4m3fn


def fake_fa3_varlen(
    q,
    k_cache,
    v_cache,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    *,
    seqused_k=None,
    softmax_scale,
    causal,
    window_size=None,
    softcap=0.0,
    block_table=None,
    return_softmax_lse=False,
    out,
    fa_version,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    s_aux=None,
    q_v=None,
):
    """Paged attention of request ``b``'s queries over the first ``seqused_k[b]`` keys of its
    ``block_table`` row (``causal``: bottom-right aligned); natural-log LSE ``[Hq, T]``, ``-inf``
    (and a zero output) for a request without keys, as FA3 returns them.

    fp8 (FA3's contract, checked): q, k and v all e4m3, descales ``[num_seqs, Hkv]`` float32, a
    bfloat16 output, attention of ``q * q_descale`` over ``k * k_descale`` / ``v * v_descale``.
    ``s_aux``: ``[Hq]`` bfloat16 sink logits, at most 64 query heads (vLLM's fork checks both): one more logit
    per head with no value row.
    ``q_v [T, Hq, Dv]`` (FA3's MLA input): the logits add ``q_v . v``; the output is ``[T, Hq, Dv]``.
    Cache-free (``cu_seqlens_k``, no block table): ``k_cache [Tk, Hkv, D]`` / ``v_cache [Tk, Hkv, Dv]``
    hold request ``b``'s keys at rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``."""
    assert fa_version == 3 and max_seqlen_q >= 1 and max_seqlen_k >= 1
    if block_table is None:  # the cache-free call: FA3 takes exactly one of the two
        assert cu_seqlens_k is not None and seqused_k is None and out is not None
        assert k_cache.dim() == v_cache.dim() == 3 and k_cache.shape[:2] == v_cache.shape[:2]
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        block_table = cu_seqlens_k[:-1, None] + torch.arange(max(max_seqlen_k, 1), device=q.device)
        block_table = block_table.clamp(max=max(k_cache.shape[0] - 1, 0))
        k_cache, v_cache = k_cache.unsqueeze(1), v_cache.unsqueeze(1)
    else:
        assert cu_seqlens_k is None
    B, hkv = cu_seqlens_q.numel() - 1, k_cache.shape[2]
    fp8 = q.dtype == E4M3
    if fp8:
        assert k_cache.dtype == v_cache.dtype == E4M3 and out.dtype == torch.bfloat16
        for t in (q_descale, k_descale, v_descale):
            assert t is not None and t.shape == (B, hkv) and t.dtype == torch.float32
    else:
        assert q_descale is k_descale is v_descale is None
    T, H, D = q.shape
    P, Dv = k_cache.shape[1], v_cache.shape[-1]
    assert q_v is None or (q_v.shape == (T, H, Dv) and q_v.dtype == q.dtype)
    lse = torch.full((H, T), -math.inf, device=q.device)
    o = torch.zeros(T, H, Dv, device=q.device)
    for b in range(B):
        q0, q1, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        if n == 0 or q1 == q0:
            continue
        assert q1 - q0 <= max_seqlen_q and n <= max_seqlen_k
        pages = block_table[b, : -(-n // P)].long()
        k = k_cache[pages].reshape(-1, hkv, D)[:n].float()
        v = v_cache[pages].reshape(-1, hkv, Dv)[:n].float()
        qb = q[q0:q1].float()
        if fp8:
            k, v = k * k_descale[b][None, :, None], v * v_descale[b][None, :, None]
            qb = qb * q_descale[b].repeat_interleave(H // hkv)[None, :, None]
        k, v = k.repeat_interleave(H // hkv, 1), v.repeat_interleave(H // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", qb, k)
        if q_v is not None:
            s = s + torch.einsum("qhd,khd->hqk", q_v[q0:q1].float(), v)
        s = s * softmax_scale
        if causal:
            pos = torch.arange(n - (q1 - q0), n, device=q.device)[:, None]
            s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, -math.inf)
        if s_aux is not None:  # the sink: one more column, a zero value row
            assert s_aux.shape == (H,) and s_aux.dtype == torch.bfloat16 and H <= 64
            s = torch.cat([s, s_aux.float()[:, None, None].expand(H, q1 - q0, 1)], -1)
            v = torch.cat([v, v.new_zeros(1, H, Dv)])
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        o[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    out.copy_(o)
    return (out, lse) if return_softmax_lse else out


def fa3_on_cpu(cfg, device):
    """An fa3 provider for ``cfg`` on ``device`` that calls :func:`fake_fa3_varlen`, built by
    ``FA3Provider.__init__`` itself (so its own state is whatever ``__init__`` sets) with the sm90
    check and the config checks skipped: callers check ``cfg`` themselves, refusals included."""
    from attnplug.core.providers.fa3 import FA3Provider

    with pytest.MonkeyPatch.context() as mp:
        patch_fa3(mp)
        mp.setattr(FA3Provider, "check_kv_dtype", lambda self, config: None)
        mp.setattr(FA3Provider, "check_config", lambda self, config: None)
        return FA3Provider(cfg, torch.device(device))


def patch_fa3(monkeypatch) -> None:
    """Every ``FA3Provider(cfg, device)`` made from here on (the graph state's and its cascade part's)
    calls :func:`fake_fa3_varlen`: no sm90 check, the stand-in as the loaded build. The shared provider
    instances start empty for the test, so none built with another library (an earlier test's) is reused."""
    from attnplug.core.providers import fa3

    fresh_provider_instances(monkeypatch)
    monkeypatch.setattr(fa3.FA3Provider, "check_available", classmethod(lambda cls, device: None))
    monkeypatch.setattr(fa3, "load_fa3", lambda: fa3.FA3Lib("fake", fake_fa3_varlen, varlen_style=True))


def use_fa3(monkeypatch, device: str) -> None:
    """The fa3 provider's library for a test: the real FA3 on a CUDA machine (the test skips where it is
    missing), the stand-in on CPU (so the provider's own logic runs in CI)."""
    if device == "cuda":
        from attnplug.core.providers.base import ProviderUnavailable
        from attnplug.core.providers.fa3 import FA3Provider

        try:
            FA3Provider.check_available(torch.device(device))
        except ProviderUnavailable as e:
            pytest.skip(f"no FA3 on this CUDA machine: {e}")
    else:
        patch_fa3(monkeypatch)
