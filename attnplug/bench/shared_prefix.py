"""Batches whose requests share prefixes, laid out the way a serving engine lays them out.

The core's :class:`~attnplug.core.paged_kv.PagedKVManager` with its
:class:`~attnplug.core.radix_tree.RadixCache` places every request: a request whose prompt starts
with tokens an earlier request cached reuses those *pages* (the same page ids, by reference count),
exactly as vLLM's and SGLang's prefix caches do; only whole pages are shared, so a shared prefix
that ends mid-page leaves its tail in each request's private page. The benchmark's shared-prefix
rows, the cascade tests and the engine-free demo all build their batches here.
"""

from __future__ import annotations

import torch

from ..core import AttentionConfig, BatchMetadata, ForwardMode
from ..core.draft import build_tree_verify_mask
from ..core.paged_kv import PagedKVManager


def prompts(groups: list[tuple[int, int]], unique: int, nested: int = 0, seed: int = 0) -> list[list[int]]:
    """Token ids: for each ``(requests, shared_tokens)`` group, that many prompts starting with the
    group's own ``shared_tokens`` random tokens, then ``unique`` private ones. ``nested > 0``: every
    group's prompt also starts with one common ``nested``-token preamble (nested prefixes)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, 1 << 30, (n,), generator=g).tolist()  # noqa: E731
    pre = rand(nested)
    out = []
    for n, shared in groups:
        head = pre + rand(shared)
        out += [head + rand(unique) for _ in range(n)]
    return out


def layout(token_lists: list[list[int]], new_tokens: int, page_size: int, spare_pages: int = 8):
    """Place each prompt through a prefix-caching :class:`PagedKVManager` (in order: a prompt reuses
    the cached pages of earlier ones), then append ``new_tokens`` query tokens to every request.

    Returns:
        ``(manager, rids, num_pages)``: the manager, request ids ``0..B-1``, and the pages it owns.
    """
    need = sum(-(-(len(t) + new_tokens) // page_size) for t in token_lists) + spare_pages
    kv = PagedKVManager(need, page_size, enable_prefix_cache=True)
    for rid, toks in enumerate(token_lists):
        kv.add_request(rid, toks)
        kv.cache_request(rid, toks)
        kv.extend(rid, new_tokens)
    return kv, list(range(len(token_lists))), need


def shared_prefix_batch(
    config: AttentionConfig,
    mode: ForwardMode,
    token_lists: list[list[int]],
    q_len: int = 1,
    seed: int = 0,
    device: torch.device | str = "cpu",
):
    """A ``mode`` batch (DECODE: ``q_len = 1``; TARGET_VERIFY: a random draft tree of ``q_len``
    tokens; EXTEND: ``q_len`` new tokens, causal) over the engine-style layout of ``token_lists``.

    Returns:
        ``(batch, q [T, Hq, D], k_cache, v_cache, num_pages)``; host metadata, tensors on ``device``.
    """
    kv, rids, num_pages = layout(token_lists, q_len, config.page_size)
    kv_indptr, kv_indices, last = kv.csr(rids)
    g = torch.Generator().manual_seed(seed)
    B = len(rids)
    mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        parents = torch.stack(
            [
                torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q_len)])
                for _ in range(B)
            ]
        )
        prefix = torch.tensor([kv.seq_len(r) - q_len for r in rids])
        mask = build_tree_verify_mask(parents, prefix)
    qo = torch.arange(B + 1, dtype=torch.int32) * q_len
    batch = BatchMetadata(mode, qo, kv_indptr, kv_indices, last, custom_mask=mask)
    dt, shape = config.dtype, config.kv_cache_shape(num_pages)
    k = torch.randn(shape, generator=g).to(dt).to(device)
    v = torch.randn(shape, generator=g).to(dt).to(device)
    q = torch.randn(B * q_len, config.num_qo_heads, config.head_dim, generator=g).to(dt).to(device)
    return batch, q, k, v, num_pages
