"""The ``fa3`` provider's MLA class: FlashAttention-3's MLA path (the ``qv`` input of its paged call).

Constructing :class:`~attnplug.core.providers.fa3.FA3Provider` with an MLA config yields this class. FA3
computes ``softmax(q_pe . k_pe + qv . c) @ c`` with ``q = q_pe [T, H, Dr]``, ``k_cache = k_pe [pages, P, 1,
Dr]``, ``v_cache = c [pages, P, 1, R]`` and ``qv = q_nope`` (absorbed) ``[T, H, R]``: views of attnplug's
``q [T, H, R + Dr]`` and latent cache (vLLM's FLASH_ATTN_MLA calls it the same way). Everything else is the
GQA provider's: block table, graphs, cascade; a tree-masked verify runs FA3 on the prefix and attnplug's
Triton MLA kernel on the tree part, LSE-merged. Refused: fp8 latent caches, float32, shapes other than
512 + 64.
"""

from __future__ import annotations

import torch

from ..config import AttentionConfig
from ..mla import library_refusal
from .fa3 import FA3Provider


class FA3MLAProvider(FA3Provider):
    """FA3's ``qv`` MLA kernels for MLA configs (``config.is_mla``)."""

    IS_MLA = True
    KV_DTYPES = frozenset((torch.float16, torch.bfloat16))

    @classmethod
    def mla_refusal(cls, config: AttentionConfig) -> str | None:
        return library_refusal(config, "FA3")

    def check_config(self, config: AttentionConfig) -> None:
        """Everything is checked by :meth:`mla_refusal` and :attr:`KV_DTYPES`."""

    def library_inputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        """``q_pe``, the rope columns of the latent cache, its first ``R`` columns (``v_cache``),
        ``qv=q_nope``."""
        R = self.config.kv_lora_rank
        return q[..., R:], k_cache[..., R:], v_cache, {"qv": q[..., :R]}


__all__ = ["FA3MLAProvider"]
