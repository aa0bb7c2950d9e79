"""Random paged batches for kernel tests: ragged lengths, permuted page tables, random tree masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.bench.workloads import random_tree_mask
from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode


@dataclass
class PagedCase:
    config: AttentionConfig
    batch: BatchMetadata
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_pages: int


def random_case(
    mode: ForwardMode,
    q_lens: list[int],
    prefix_lens: list[int],
    config: AttentionConfig,
    device: str | torch.device = "cpu",
    seed: int = 0,
    extra_pages: int = 7,
    mask_kind: str = "tree",
) -> PagedCase:
    """A batch whose request ``b`` has ``prefix_lens[b]`` cached tokens then ``q_lens[b]`` new ones.

    Pages are a random permutation of ``[0, num_pages)`` (with spare pages that hold garbage, so a
    wrong page index shows up). For TARGET_VERIFY a custom mask is built: all prefix keys visible,
    a random tree over the draft tokens (``mask_kind="tree"``) or random bits (``"random"``, every
    row keeps at least one key).
    """
    gen = torch.Generator().manual_seed(seed)
    P = config.page_size
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    n_pages = [-(-l // P) for l in kv_lens]
    num_pages = sum(n_pages) + extra_pages
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    kv_indices = perm[: sum(n_pages)].clone()
    kv_indptr = torch.tensor([0] + n_pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([(l - 1) % P + 1 if l else 0 for l in kv_lens], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    shape = config.kv_cache_shape(num_pages)
    dt = config.dtype
    k_cache = torch.randn(shape, generator=gen).to(dt)
    v_cache = torch.randn(shape, generator=gen).to(dt)
    q = torch.randn(sum(q_lens), config.num_qo_heads, config.head_dim, generator=gen).to(dt)
    mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        blocks = []
        for ql, kl in zip(q_lens, kv_lens):
            m = torch.ones(ql, kl, dtype=torch.bool)
            if mask_kind == "tree":
                m[:, kl - ql :] = random_tree_mask(ql, gen)
            else:
                m = torch.rand(ql, kl, generator=gen) < 0.5
                m[torch.arange(ql), torch.randint(0, max(kl, 1), (ql,), generator=gen)] = True
            blocks.append(m.flatten())
        mask = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    batch = BatchMetadata(mode, qo_indptr, kv_indptr, kv_indices, last, custom_mask=mask)
    dev = torch.device(device)
    return PagedCase(config, batch, q.to(dev), k_cache.to(dev), v_cache.to(dev), num_pages)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against reference ``b`` (NaN in ``a`` gives NaN)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
