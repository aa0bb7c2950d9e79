"""A fourth provider, added the way the README says: this one file plus one registry line
(``register_provider("toy", "toy_provider:ToyProvider", ...)``), no edit to the core or the adapters.

It is the float32 reference under another name, but it declares CUDA-graph support of the kind
FlashInfer has - decode and verify graphs refreshed by a re-plan on the host - so the graph state,
the multi-step draft planner and both adapters' graph paths run through it on CPU. Its graph part
records every refresh, so tests can see what the core handed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.core.graph_views import HostBatch
from attnplug.core.pages import tokens_from_pages
from attnplug.core.plan import Plan, ProviderState
from attnplug.core.providers import GraphSupport, Provider, ProviderGraph, register_provider
from attnplug.core.reference import reference_attention

TOY = "toy"


@dataclass
class ToyState(ProviderState):
    planned_batch: int  # the batch size this plan was built for


class ToyGraph(ProviderGraph):
    """Re-plans on the host: a refresh copies the host CSR into the plan's host twins (all the reference reads)."""

    def __init__(self, provider, gs):
        super().__init__(provider, gs)
        self.refreshes: list[tuple[int, bool]] = []  # (bs, device_table) per refresh

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        if host is None:
            raise ValueError("attnplug: provider 'toy' plans on the host: a replay needs host metadata")
        P = plan.config.page_size
        plan.kv_indptr_cpu, plan.kv_last_page_len_cpu = host.kv_indptr, host.kv_last_page_len
        plan.kv_indices_cpu = host.kv_indices.cpu()
        plan.kv_lens_cpu = tokens_from_pages(
            plan.kv_indptr_cpu[1:] - plan.kv_indptr_cpu[:-1], plan.kv_last_page_len_cpu, P
        ).to(torch.int32)
        self.refreshes.append((bs, device_table))

    def check_device_table_update(self, host_seq_lens) -> None:
        if host_seq_lens is None or self.gs.mode != "decode":
            raise self.provider.unsupported("a replay from a device page table without host lengths, or in verify mode")


class ToyProvider(Provider):
    name = TOY
    graph_support = GraphSupport(decode=True, verify=True, device_refresh=False, reason="the toy re-plans on the host")
    graph_cls = ToyGraph

    def plan(self, plan: Plan, static=None) -> None:
        plan.state = ToyState(plan.batch_size)

    def run(self, plan: Plan, q, k_cache, v_cache, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        o, s = reference_attention(plan, q, k_cache, v_cache)
        out.copy_(o)
        if lse is not None:
            lse.copy_(s)


def register(served: bool = True) -> None:
    """The one registry line (importable as ``toy_provider`` when tests/ is on ``sys.path``); ``served=False``
    takes it off the engines' backend lists again (it stays selectable as ``ATTNPLUG_PROVIDER_OVERRIDE``)."""
    register_provider(TOY, "toy_provider:ToyProvider", "nothing to install (a test provider)", served=served)


TOY_CHAIN = "toychain"


class ToyChainGraph(ToyGraph):
    """The toy's part of a causal-chain verify family (``GraphState(chain=True)``): re-planned on the host
    from host lengths after the one-launch update from a device page table, as FlashInfer's chain family."""

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        """As the toy's, plus the host twins of the chain mask's layout (FlashInfer's causal plan needs
        none: it derives the chain from the lengths)."""
        super().refresh(plan, bs, host, device_table)
        q = self.gs.q
        plan.mask_indptr_cpu = torch.cat([torch.zeros(1, dtype=torch.int64), (plan.kv_lens_cpu.long() * q).cumsum(0)])
        plan.mask_free_cpu = plan.kv_lens_cpu - q

    def check_device_table_update(self, host_seq_lens) -> None:
        if host_seq_lens is None:
            raise self.provider.unsupported("a replay from a device page table without host lengths")


class ToyChainProvider(ToyProvider):
    """The toy with FlashInfer's declared support: decode, and chain verify from a device page table with
    host lengths (``chain_verify_from_table``); tree verify through host metadata only."""

    name = TOY_CHAIN
    graph_support = GraphSupport(
        decode=True,
        verify=True,
        device_refresh=False,
        chain_verify_from_table=True,
        reason="the toy re-plans on the host",
    )
    chain_graph_cls = ToyChainGraph


def register_chain() -> None:
    """The chain toy, selectable as ``ATTNPLUG_PROVIDER_OVERRIDE`` (not served)."""
    register_provider(TOY_CHAIN, "toy_provider:ToyChainProvider", "nothing to install (a test provider)", served=False)
