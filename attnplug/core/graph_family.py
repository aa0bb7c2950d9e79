"""One CUDA-graph family of an engine backend: a :class:`~attnplug.core.cuda_graph.GraphState` per layer
config, all sized alike, updated together, and run per layer by its :class:`AttentionConfig`.

    fam = GraphFamily(provider_cls, max_batch=64, max_tokens=64, max_pages=20000, device="cuda")
    fam.add(configs)                        # the model's layer configs (others join on first use)
    fam.set_batch(bs, batch, capture=True)  # capture: plan the padded batch of bs requests
    fam.refresh_from_block_table(seq_lens, table, bs)   # replay: one launch per config, in place
    fam.run(config, bs, q, k_cache, v_cache, out, **scales)

Both engine adapters (vLLM's uniform batches, SGLang's decode / verify / draft-extend families and its
multi-step draft steps) keep their graph bookkeeping here. A layer config first seen after the
family's batch was written (a warm-up forward) catches up from that batch, outside graph capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .config import AttentionConfig, UnsupportedFeature
from .cuda_graph import GraphState
from .metadata import BatchMetadata
from .plan import Plan
from .providers import Provider


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class GraphFamily(Mapping):
    """The graph states of one family, keyed by layer :class:`AttentionConfig` (a read-only mapping).

    Args:
        provider: the provider class (or registered name) every state runs; each state gets the
            config's one instance, forked (:func:`~attnplug.core.providers.provider_instance`).
        state_config: maps a layer config to the config its state plans with (default: itself; e.g.
            the draft steps' token-granular :func:`~attnplug.core.draft.token_config`).
        refuse: builds the exception raised for what this family cannot do (the adapter's message,
            naming its backend); default :class:`UnsupportedFeature` with the text as is.
        **state_args: :class:`GraphState` arguments after ``config`` and ``provider`` (``max_batch``,
            ``max_tokens``, ``max_pages``, ``device``, ``mode``, ...), the same for every state.

    Raises:
        UnsupportedFeature (through ``refuse``): a state the provider cannot build (its graph support).
    """

    def __init__(
        self,
        provider: str | type[Provider],
        *,
        state_config: Callable | None = None,
        refuse: Callable[[str], Exception] | None = None,
        **state_args: Any,
    ):
        self.provider = provider
        self.state_config = state_config or (lambda cfg: cfg)
        self.refuse = refuse or (lambda what: UnsupportedFeature(f"attnplug: {what}"))
        self.state_args = state_args
        self.max_batch: int = state_args["max_batch"]
        decode = state_args.get("mode", "decode") == "decode"
        self.q: int = 1 if decode else int(state_args.get("num_draft_tokens", 1))  # query tokens per request
        self.states: dict[AttentionConfig, GraphState] = {}
        self._last: tuple | None = None  # how the current batch was written: ("batch", bs, batch) | ("table", ...)

    # -- mapping: config -> GraphState ---------------------------------------------------------------
    def __getitem__(self, config: AttentionConfig) -> GraphState:
        return self.states[config]

    def __iter__(self) -> Iterator[AttentionConfig]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    # -- states --------------------------------------------------------------------------------------
    def state(self, config: AttentionConfig) -> GraphState:
        """The state of ``config``, built on first use."""
        gs = self.states.get(config)
        if gs is None:
            try:
                gs = GraphState(self.state_config(config), self.provider, **self.state_args)
            except UnsupportedFeature as e:
                raise self.refuse(f"CUDA graphs here ({e})") from e
            self.states[config] = gs
        return gs

    def add(self, configs) -> GraphFamily:
        """Build the states of ``configs`` now (startup), so that capture plans them all."""
        for cfg in configs:
            self.state(cfg)
        return self

    @property
    def host_lengths(self) -> bool:
        """A replay needs host sequence lengths (a provider of the family re-plans on the host)."""
        return any(gs.needs_host_lengths for gs in self.states.values())

    @property
    def cascade_counts(self) -> torch.Tensor | None:
        """The first state's cascade counters (``GraphState.cascade_counts``), ``None`` without cascade."""
        counts = [gs.cascade_counts for gs in self.states.values() if gs.cascade_counts is not None]
        return counts[0] if counts else None

    def planned(self, bs: int) -> bool:
        """Every state holds a plan of batch size ``bs``."""
        return bs <= self.max_batch and all(bs in gs.plans for gs in self.states.values())

    def plan(self, config: AttentionConfig, bs: int) -> Plan:
        return self.states[config].plans[bs]

    # -- writing the batch ---------------------------------------------------------------------------
    def plan_for(self, bs: int) -> None:
        """Plans of batch size ``bs`` where missing (host work; outside any graph)."""
        for gs in self.states.values():
            if bs not in gs.plans:
                gs.prepare_capture(bs)

    def set_batch(self, bs: int, batch: BatchMetadata, capture: bool = False) -> None:
        """Write ``batch`` (its ``B <= bs`` real requests) into every state's ``bs`` plan: planned anew
        at ``capture`` or where ``bs`` has no plan yet (host metadata), else updated in place
        (``GraphState.update``)."""
        for gs in self.states.values():
            if capture or bs not in gs.plans:
                gs.prepare_capture(bs, batch)
            else:
                gs.update(batch, bs)
        self._last = ("batch", bs, batch)

    def refresh_from_block_table(self, seq_lens: torch.Tensor, block_table: torch.Tensor, bs: int, **kw: Any) -> None:
        """``GraphState.update_from_block_table`` of every state, whose ``bs`` plan is made first where
        missing (host work: then outside any graph). ``kw``: ``row_ids``, ``entry_tokens``,
        ``host_seq_lens`` as there."""
        for gs in self.states.values():
            if bs not in gs.plans:
                gs.prepare_capture(bs)
            gs.update_from_block_table(seq_lens, block_table, bs, **kw)
        self._last = ("table", bs, (seq_lens, block_table), kw)

    # -- per layer -----------------------------------------------------------------------------------
    def run(
        self,
        config: AttentionConfig,
        bs: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        **scales: Any,
    ) -> torch.Tensor:
        """``GraphState.run`` of ``config``'s state (launches only: capturable). A config first seen now
        (a warm-up forward) is planned from the family's current batch; inside capture, or where that
        batch lives on the device only, it is refused."""
        gs = self.states.get(config)
        if gs is None or bs not in gs.plans:
            gs = self._catch_up(config, bs)
        return gs.run(bs, q, k_cache, v_cache, out, **scales)

    def _catch_up(self, config: AttentionConfig, bs: int) -> GraphState:
        last = self._last
        if _capturing():
            raise self.refuse(f"a layer config {config} first seen inside CUDA-graph capture")
        if last is None or last[1] != bs:
            raise self.refuse(f"a layer config {config} first seen before its graph batch was written")
        if last[0] == "batch" and last[2].kv_indptr.device.type != "cpu":
            raise self.refuse(f"a layer config {config} first seen at CUDA-graph replay")
        gs = self.state(config)
        if last[0] == "batch":
            gs.prepare_capture(bs, last[2])
        else:
            gs.prepare_capture(bs)
            gs.update_from_block_table(*last[2], bs, **last[3])
        return gs
