"""The ``flashinfer`` provider's MLA class: FlashInfer's ``BatchMLAPagedAttentionWrapper`` (absorbed MLA).

Constructing :class:`~attnplug.core.providers.flashinfer.FlashInferProvider` with an MLA config yields this
class. The wrapper reads ``q_nope [T, H, R]`` / ``q_pe [T, H, Dr]`` and the caches ``ckv [pages, P, R]`` /
``kpe [pages, P, Dr]``: all four are views of attnplug's ``q [T, H, R + Dr]`` and latent cache (no copy).
Causal (bottom-right) or non-causal plans: decode, prefill / extend, chain verify, the cascade's prefix
parts. Refused: tree-masked verify (the wrapper takes no custom mask), fp8 latent caches (FlashInfer reads
them only with host scales on its sm90 template), float32, latent shapes other than 512 + 64.
CUDA graphs: one ``use_cuda_graph=True`` wrapper per batch size over the graph state's static buffers,
re-planned on the host before each replay (as the GQA provider's graphs).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import AttentionConfig
from ..graph_views import HostBatch
from ..mla import library_refusal
from ..pages import tokens_from_pages
from ..plan import Plan, PlanOptions
from .base import ProviderGraph
from .flashinfer import FlashInferChainVerifyGraph, FlashInferProvider, FlashInferState

TREE = "tree-masked verify with MLA (FlashInfer's MLA wrapper takes no custom mask)"


class FlashInferMLAGraph(FlashInferChainVerifyGraph):
    """Decode and causal-chain verify graphs: a ``use_cuda_graph=True`` MLA wrapper per batch size whose
    buffers are the graph state's static ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``kv_lens``;
    before each replay it is planned again from host lengths (its plan copies into those buffers). A replay
    from a device page table needs host lengths, as the GQA chain-verify graphs."""

    def __init__(self, provider: FlashInferMLAProvider, gs):
        if gs.mode != "decode" and not getattr(gs, "chain", False):
            raise provider.unsupported(f"CUDA graphs of {TREE}")
        ProviderGraph.__init__(self, provider, gs)
        self.wrappers: dict[int, object] = {}

    def plan(self, plan: Plan, bs: int) -> None:
        p, gs = self.provider, self.gs
        v = gs.static_views(bs)
        wr = p._fi.BatchMLAPagedAttentionWrapper(
            p._workspace,
            use_cuda_graph=True,
            qo_indptr=v.qo_indptr,
            kv_indptr=v.kv_indptr,
            kv_indices=gs.kv_indices,
            kv_len_arr=v.kv_lens,
        )
        self.wrappers[bs] = wr
        p.plan_wrapper(wr, plan.qo_indptr_cpu, plan.kv_indptr_cpu, plan.kv_indices, plan.kv_lens_cpu, plan.causal)
        plan.state = FlashInferState(wr, "mla")

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        if host is None:
            raise ValueError(
                "attnplug: provider 'flashinfer' plans on the host: an MLA graph replay needs "
                "host kv_indptr / kv_last_page_len (host metadata, or host_seq_lens)"
            )
        gs, P = self.gs, self.provider.config.page_size
        indptr, last = host.kv_indptr, host.kv_last_page_len
        kv_lens = tokens_from_pages(indptr[1:] - indptr[:-1], last, P).to(torch.int32)
        qo = torch.arange(bs + 1, dtype=torch.int32) * gs.q
        self.provider.plan_wrapper(
            self.wrappers[bs], qo, indptr, gs.kv_indices[: host.kv_indices.numel()], kv_lens, gs.mode != "decode"
        )


class FlashInferMLAProvider(FlashInferProvider):
    """FlashInfer's MLA paged wrapper for MLA configs (``config.is_mla``)."""

    IS_MLA = True
    Options = PlanOptions  # no knobs (the base)
    graph_support = dataclasses.replace(
        FlashInferProvider.graph_support,
        reason=(
            "FlashInfer plans on the host before each replay; its MLA wrapper takes no custom mask (tree verify "
            "refused)"
        ),
    )
    graph_cls = FlashInferMLAGraph
    chain_graph_cls = None
    KV_DTYPES = frozenset((torch.float16, torch.bfloat16))

    @classmethod
    def mla_refusal(cls, config: AttentionConfig) -> str | None:
        return library_refusal(config, "FlashInfer")

    def check_config(self, config: AttentionConfig) -> None:
        """Everything is checked by :meth:`mla_refusal` and :attr:`KV_DTYPES`."""

    def check_tree_config(self) -> None:
        raise self.unsupported(TREE)

    def _mla_wrapper(self):
        w = self._wrappers.get(("mla", "auto"))
        if w is None:
            w = self._wrappers[("mla", "auto")] = self._fi.BatchMLAPagedAttentionWrapper(self._workspace)
        return w

    def plan_wrapper(self, wrapper, qo_indptr, kv_indptr, kv_indices, kv_lens, causal: bool) -> None:
        """One MLA wrapper ``plan`` (host ``qo_indptr`` / ``kv_indptr`` / ``kv_lens``, device
        ``kv_indices``)."""
        cfg = self.config
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_lens,
            cfg.num_qo_heads,
            cfg.kv_lora_rank,
            cfg.rope_dim,
            cfg.page_size,
            bool(causal),
            cfg.scale,
            cfg.dtype,
            cfg.kv_dtype,
        )

    def plan(self, plan: Plan, static=None) -> None:
        if plan.mask is not None:
            raise self.unsupported(TREE)
        w = self._mla_wrapper()
        self.plan_wrapper(
            w,
            plan.qo_indptr_cpu,
            plan.kv_indptr_cpu,
            plan.kv_indices,
            plan.kv_lens_cpu,
            plan.causal and plan.max_q_len > 1,
        )
        plan.state = FlashInferState(w, "mla")

    def run(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        k_scale=None,
        v_scale=None,
        q_scale=None,
        host_scales=None,
        sinks=None,
    ) -> None:
        """``q [T, H, R + Dr]``, latent ``k_cache [pages, P, 1, R + Dr]`` -> ``out [T, H, R]`` (+ natural-log
        ``lse [T, H]``); the wrapper reads views of both."""
        R = self.config.kv_lora_rank
        lat = k_cache.squeeze(2)
        plan.state.wrapper.run(
            q[..., :R],
            q[..., R:],
            lat[..., :R],
            lat[..., R:],
            out=out,
            lse=lse,
            return_lse=lse is not None,
            return_lse_base_on_e=True,
        )


__all__ = ["FlashInferMLAProvider"]
