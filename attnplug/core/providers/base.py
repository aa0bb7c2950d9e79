"""The provider contract: everything specific to one kernel library, behind one interface.

A provider decides, for its library:

* **capabilities** - :meth:`Provider.check_available` (device, library), :meth:`Provider.check_config`
  (features of an :class:`~attnplug.core.config.AttentionConfig`), :meth:`Provider.check_capability`
  (a CUDA compute capability, before any device exists), :attr:`Provider.KV_DTYPES` (the KV-cache
  dtypes it reads, fp8 included or not), :meth:`Provider.preferred_kv_layout` (the cache layout its
  kernels read fastest, where an engine lets the backend choose), :attr:`Provider.graph_support` (what its
  CUDA graphs can replay, and why not more), :meth:`Provider.prepare_process` (what a process must
  do before the library is imported, e.g. the Triton interpreter on CPU), :meth:`Provider.supports_sinks`
  (attention sinks, ``config.sinks``: :attr:`Provider.NATIVE_SINKS` where the library's kernels take
  them, else the core joins them after the run, :meth:`Provider.run_folded`), :meth:`Provider.supports_mla`
  (MLA configs, ``config.is_mla``: served by :meth:`Provider.mla_class`, a subclass that constructing the
  provider with such a config yields, :mod:`attnplug.core.mla`), :meth:`Provider.ragged_class` (cache-free
  prefill, :mod:`attnplug.core.ragged`: its :class:`RaggedKernel`);
* **one forward** - :meth:`Provider.plan` (host work, once per forward; the launch arguments go into
  ``plan.state``, typed) and :meth:`Provider.run` (per layer, launches only);
* **plan knobs** - :attr:`Provider.Options` (its own :class:`~attnplug.core.plan.PlanOptions` subclass,
  declared in its module), :meth:`Provider.parse_options` (the caller's knobs, unknown ones refused),
  :meth:`Provider.takes_split_count` and :meth:`Provider.pinned_options` (what a graph part or draft step
  pins);
* **static buffers** - :meth:`Provider.static_buffers` (storage that lets ``plan`` write into fixed
  memory: multi-step drafts and CUDA graphs) and :meth:`Provider.graph` (its part of a
  :class:`~attnplug.core.cuda_graph.GraphState`: capture-time plans and the in-place refresh before
  a replay, a :class:`ProviderGraph`);
* **instances** - :meth:`Provider.fork` (a second plan state over the same resources, when a plan
  lives inside the library's object, as FlashInfer's wrappers): the core makes one instance per
  (layer config, provider) (:func:`~attnplug.core.providers.provider_instance`) and forks it for
  graph families, cascade parts and draft steps (:meth:`Provider.step_providers`);
* **tree verify** - :meth:`Provider.check_tree_config`;
* its **install hint** - the registry table in :mod:`attnplug.core.providers`.

``GraphState``, the draft planner and the engine adapters ask these; they never compare names.
A new provider is one module implementing this class plus one line in the registry table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from ..config import SUPPORTED_DTYPES, AttentionConfig, UnsupportedFeature
from ..graph_views import HostBatch
from ..plan import Plan, PlanOptions, ProviderStatic

if TYPE_CHECKING:
    from ..cuda_graph import GraphState
    from ..ragged import RaggedConfig, RaggedPlan


class ProviderUnavailable(RuntimeError):
    """The provider cannot run on this machine (missing GPU or library); the message says how to fix it."""


class GraphTiles(NamedTuple):
    """The tile list of a cascade graph's prefix part (:meth:`Provider.graph_tile_list`), in static memory the
    graph update rewrites before each replay: tile ``i`` is ``block_q`` query rows of slot ``tile_req[i]`` from
    its row ``tile_qstart[i]`` (``[max_tiles]`` int32 each). ``count`` ``None``: every slot has its tiles and the
    tiles past them point at a slot without rows or keys. ``count [1]`` int32: only the slots with keys (the
    groups cut at this replay) have tiles, first in the list, and ``count`` holds their number."""

    tile_req: torch.Tensor
    tile_qstart: torch.Tensor
    block_q: int
    count: torch.Tensor | None = None


@dataclass(frozen=True)
class GraphSupport:
    """What a provider's CUDA graphs can replay (:attr:`Provider.graph_support`).

    Attributes:
        decode: single-token batches replay from static buffers (``GraphState`` decode mode, and
            the steps of a multi-step draft).
        verify: uniform multi-token batches (spec-decode verify with a tree or chain mask) replay.
        device_refresh: the refresh before a replay is device work only (so it can itself be
            captured, e.g. vLLM's in-graph draft updates, and runs from a device page table in every
            mode). ``False``: the provider re-plans on the host before each replay, from host
            lengths (``kv_indptr`` / ``kv_last_page_len``), and from a device page table only in
            decode mode.
        reason: what is not supported and why (shown in refusals); ``""`` when everything is.
        cascade: decode and verify graphs can read a shared prefix once (``GraphState(cascade=...)``):
            the prefix part (:meth:`Provider.graph_prefix_provider`, :meth:`Provider.graph_tile_list`)
            runs a non-causal plan of ``bs * q`` query rows in ``bs + 1`` slots (one a group) over device
            lengths from static memory, next to the suffix plan, which must give an LSE.
        chain_verify_from_table: with ``device_refresh`` False: verify families of causal-chain
            masks (``GraphState(chain=True)``, vLLM's linear spec decode) replay from a device page
            table given host lengths (``update_from_block_table(host_seq_lens=...)``), as decode does.
            Implied by ``device_refresh``.
    """

    decode: bool
    verify: bool
    device_refresh: bool
    reason: str = ""
    cascade: bool = False
    chain_verify_from_table: bool = False

    @property
    def chain_verify(self) -> bool:
        """Causal-chain verify batches replay from a device page table (with host lengths where the
        provider plans on the host)."""
        return self.verify and (self.device_refresh or self.chain_verify_from_table)


NO_GRAPHS = GraphSupport(False, False, False, "it plans and runs with host work per forward")


class ProviderGraph:
    """A provider's part of one :class:`~attnplug.core.cuda_graph.GraphState` (one graph family).

    ``GraphState`` owns the provider-neutral static buffers (page CSR, lengths, mask) and calls:

    * :meth:`plan` once per captured batch size ``bs`` (outside the graph; host work allowed): the
      plan's tensors are views of the static buffers, and ``plan.state`` must only reference
      static memory, so that a refreshed buffer is what the captured launches read;
    * :meth:`refresh` after every replay-time rewrite of those buffers (in place; host work only
      when :attr:`GraphSupport.device_refresh` is False).

    Attributes:
        block_table: ``[max_batch, W]`` int32 when the provider reads a padded block table (FA3):
            ``GraphState``'s one-launch update writes its rows too. ``None`` otherwise.
    """

    block_table: torch.Tensor | None = None

    def __init__(self, provider: Provider, gs: GraphState):
        self.provider, self.gs = provider, gs
        self.static = provider.static_buffers(
            max_rows=gs.max_batch,
            max_tokens=gs.max_tokens,
            max_kv_len=gs.max_seq_len,
            q=gs.q,
            num_kv_splits=gs.num_kv_splits,
        )

    def plan(self, plan: Plan, bs: int) -> None:
        """Plan the padded batch of ``bs`` requests into static memory (default: ``Provider.plan``
        with :meth:`Provider.static_buffers`)."""
        self.provider.plan(plan, static=self.static)

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        """After the static buffers of ``bs`` were rewritten. ``host``: host twins of the padded
        batch (:class:`~attnplug.core.graph_views.HostBatch`) or ``None``;
        ``device_table``: the one-launch update from a device page table wrote them (and
        :attr:`block_table`). Default: nothing to do."""

    def check_device_table_update(self, host_seq_lens: torch.Tensor | None) -> None:
        """Raise :class:`UnsupportedFeature` when a one-launch update from a device page table
        cannot refresh this provider's plan (default: it always can)."""


class Provider(ABC):
    """One kernel library behind the core's plan/run contract.

    Subclasses set ``name`` (the registry key), ``Options`` (where they take plan knobs) and implement
    ``plan`` and ``run``;
    everything else has a default that fits a provider with no special needs.
    """

    name: ClassVar[str] = "?"
    #: Its plan knobs: a :class:`~attnplug.core.plan.PlanOptions` subclass declared in its module (the
    #: base: no knobs). :meth:`parse_options` builds it; its ``plan`` reads ``Options.of(plan.options)``.
    Options: ClassVar[type[PlanOptions]] = PlanOptions
    #: What its CUDA graphs can replay (see :class:`GraphSupport`).
    graph_support: ClassVar[GraphSupport] = NO_GRAPHS
    #: Whether :meth:`run` on an eager plan (``PagedAttention.plan``) can be captured in a CUDA graph as
    #: it is and replayed on that plan; where not, graphs go through ``GraphState`` only.
    EAGER_RUN_CAPTURABLE: ClassVar[bool] = True
    #: Its part of a ``GraphState`` (subclass of :class:`ProviderGraph`).
    graph_cls: ClassVar[type[ProviderGraph]] = ProviderGraph
    #: Its part of a causal-chain verify family (``GraphState(chain=True)``) where that differs; ``None``:
    #: :attr:`graph_cls`.
    chain_graph_cls: ClassVar[type[ProviderGraph] | None] = None
    #: KV-cache dtypes it reads (``config.kv_dtype``): a provider that lists an fp8 dtype dequantizes
    #: with the per-layer scales its :meth:`run` receives. Default: unquantized caches only.
    KV_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset(SUPPORTED_DTYPES)
    #: Attention sinks (``config.sinks``) computed by its own kernels: :meth:`run` takes ``sinks`` in every
    #: mode. ``False``: its :meth:`run` hands a ``sinks`` argument to :meth:`run_folded` (run without the
    #: sink with the LSE, then the core's exact join, :func:`~attnplug.core.kernels.merge.apply_sinks`).
    NATIVE_SINKS: ClassVar[bool] = False
    #: MLA (``config.is_mla``, :mod:`attnplug.core.mla`): ``"module:Class"`` (relative to this package) of
    #: the subclass serving MLA configs, which constructing this class with one yields (:meth:`mla_class`);
    #: ``None``: refused. A class that itself serves MLA configs sets :attr:`IS_MLA`.
    MLA_IMPL: ClassVar[str | None] = None
    IS_MLA: ClassVar[bool] = False
    #: Cache-free (ragged) prefill (:mod:`attnplug.core.ragged`): ``"module:Class"`` (relative to this
    #: package) of its :class:`RaggedKernel`; ``None``: refused.
    RAGGED_IMPL: ClassVar[str | None] = None

    def __new__(cls, config: AttentionConfig | None = None, *args, **kwargs):
        """An MLA config builds :meth:`mla_class` (a subclass) where this class does not serve it itself."""
        mla = cls.mla_class() if getattr(config, "is_mla", False) and not cls.IS_MLA else None
        return super().__new__(mla if mla is not None else cls)

    def __init__(self, config: AttentionConfig, device: torch.device):
        self.config = config
        self.device = device
        self.check_available(device)
        self.check_mla(config)
        self.check_kv_dtype(config)
        self.check_sinks(config)
        self.check_config(config)

    # -- capabilities ---------------------------------------------------------------------------------
    @classmethod
    def check_available(cls, device: torch.device) -> None:
        """Raise :class:`ProviderUnavailable` (with the install hint) when this provider cannot run on ``device``."""

    @classmethod
    def check_capability(cls, major: int, minor: int) -> str | None:
        """Why this provider cannot run on a CUDA device of compute capability ``major.minor``
        (checked before a device exists, e.g. by an engine's backend selector); ``None`` if it can."""
        return None

    @classmethod
    def preferred_kv_layout(cls, kv_dtype: torch.dtype | None) -> str | None:
        """The cache layout (``"NHD"`` ``[pages, P, Hkv, D]`` or ``"HND"`` ``[pages, Hkv, P, D]``) this
        provider's kernels read fastest for a KV cache of ``kv_dtype`` (``None``: the model dtype),
        for engines that let the attention backend choose the physical layout; ``None``: no preference
        (the engine's default). Never raises."""
        return None

    @classmethod
    def prepare_process(cls, device_type: str) -> None:
        """What this process must do before the provider's library is imported (called by the
        engine adapters when the provider is selected; default: nothing)."""

    @classmethod
    def unavailable(cls, reason: str) -> ProviderUnavailable:
        """A :class:`ProviderUnavailable` naming attnplug, this provider, ``reason`` and the install hint."""
        from . import install_hint  # noqa: PLC0415 - the registry imports this module

        return ProviderUnavailable(
            f"attnplug: provider '{cls.name}' is unavailable: {reason}. To install: {install_hint(cls.name)}"
        )

    @classmethod
    def supports_sinks(cls) -> bool:
        """Whether this provider computes attention sinks (``AttentionConfig.sinks``) in every mode it
        runs, natively (:attr:`NATIVE_SINKS`) or through :meth:`run_folded`; asked before any device
        exists (engine adapters). Default: ``True`` (every provider's :meth:`run` writes the LSE the
        fold needs); a provider that cannot returns ``False`` and is refused at construction."""
        return True

    @classmethod
    def supports_mla(cls) -> bool:
        """Whether this provider serves MLA configs (``AttentionConfig.is_mla``); asked before any device
        exists (engine adapters). :meth:`mla_class` is the class that does (its graph support, KV dtypes)."""
        return cls.mla_class() is not None

    @classmethod
    def mla_class(cls) -> type[Provider] | None:
        """The class serving this provider's MLA configs: this one (:attr:`IS_MLA`), the subclass
        :attr:`MLA_IMPL` names, or ``None`` (MLA refused)."""
        if cls.IS_MLA:
            return cls
        return _load_impl(cls.MLA_IMPL)

    @classmethod
    def ragged_class(cls) -> type[RaggedKernel] | None:
        """The class running this provider's cache-free prefill (:attr:`RAGGED_IMPL`), or ``None``."""
        return _load_impl(cls.RAGGED_IMPL)

    @classmethod
    def mla_refusal(cls, config: AttentionConfig) -> str | None:
        """On the MLA class (:meth:`mla_class`): the feature of the MLA ``config`` it cannot serve (e.g. a
        head dim), for the refusal; ``None`` when it can. Checked without a device."""
        return None

    def check_mla(self, config: AttentionConfig) -> None:
        """Raise :class:`UnsupportedFeature` for an MLA config this class does not serve."""
        if config.is_mla and not self.IS_MLA:
            raise self.unsupported("MLA (multi-head latent attention: head_dim_v != head_dim)")
        refusal = self.mla_refusal(config) if config.is_mla else None
        if refusal:
            raise self.unsupported(refusal)

    def check_sinks(self, config: AttentionConfig) -> None:
        """Raise :class:`UnsupportedFeature` for ``config.sinks`` when :meth:`supports_sinks` is false."""
        if config.sinks and not self.supports_sinks():
            raise self.unsupported("attention sinks")

    def check_config(self, config: AttentionConfig) -> None:
        """Raise :class:`UnsupportedFeature` for configurations this provider cannot compute."""

    @classmethod
    def kv_dtype_refusal(cls, config: AttentionConfig) -> str | None:
        """The refused feature when ``config.kv_dtype`` is not in :attr:`KV_DTYPES` (an MLA config: its
        latent cache), else ``None``. Checked without a device."""
        if config.kv_dtype in cls.KV_DTYPES:
            return None
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in cls.KV_DTYPES))
        what = "an MLA latent cache of" if config.is_mla else "KV-cache dtype"
        return f"{what} {str(config.kv_dtype).removeprefix('torch.')} (it reads: {names})"

    def check_kv_dtype(self, config: AttentionConfig) -> None:
        """Raise :class:`UnsupportedFeature` when ``config.kv_dtype`` is not in :attr:`KV_DTYPES`."""
        refusal = self.kv_dtype_refusal(config)
        if refusal:
            raise self.unsupported(refusal)

    def check_tree_config(self) -> None:
        """Raise :class:`UnsupportedFeature` if a tree-masked verify cannot run with this config."""

    def unsupported(self, feature: str) -> UnsupportedFeature:
        return UnsupportedFeature(f"attnplug: provider '{self.name}' does not support {feature}")

    def parse_options(self, knobs: dict) -> PlanOptions:
        """The caller's ``knobs`` (``PagedAttention.plan(batch, **knobs)``) as :attr:`Options`; no knobs:
        its shared instance (nothing allocated). ``ValueError`` naming attnplug, this provider and the
        knobs it reads for any other knob."""
        return self.Options.parse(knobs, self.name)

    def takes_split_count(self) -> bool:
        """Whether its plans take a forced split-KV count (a graph family's or a draft's
        ``num_kv_splits``, which its :meth:`static_buffers` are sized by). Default: no."""
        return False

    def pinned_options(self, tiles: dict, num_kv_splits: int | None = None) -> PlanOptions:
        """The options a graph part or draft step pins on its plans: ``tiles`` (from
        :meth:`fixed_tile_options`) and ``num_kv_splits`` where :meth:`takes_split_count` (its static
        memory is sized by it; dropped otherwise, as is ``None``)."""
        if num_kv_splits is not None and self.takes_split_count():
            tiles = {**tiles, "num_kv_splits": num_kv_splits}
        return self.parse_options(tiles)

    # -- one forward ------------------------------------------------------------------------------------
    @abstractmethod
    def plan(self, plan: Plan, static: ProviderStatic | None = None) -> None:
        """Build this forward's launch arguments into ``plan.state`` (host work allowed here).

        ``static``: from :meth:`static_buffers`; when given, ``plan.state`` must reference only that
        memory and the plan's own tensors (CUDA graphs, multi-step drafts)."""

    @abstractmethod
    def run(
        self,
        plan: Plan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        host_scales: tuple[float, float] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Write attention of ``q [T, Hq, D]`` over the paged cache into ``out [T, Hq, D]``
        (and the natural-log LSE into ``lse [T, Hq]`` float32 when given). No host work.

        Scales are passed only for an fp8 ``config.kv_dtype`` (a provider without fp8 in
        :attr:`KV_DTYPES` never receives them): ``k_scale``, ``v_scale`` - one-element float32
        device tensors, keys = ``k_cache * k_scale`` (values alike) - and ``q_scale``, the scale a
        provider that quantizes q to fp8 (fa3) divides by (others ignore it). Read on the device:
        in-place updates apply, CUDA graphs capture them.

        ``host_scales``: the same ``(k_scale, v_scale)`` values as Python floats, given only by a
        caller whose engine fixes them for the process (its own backends read the same floats);
        a provider may then fold them on the host instead of reading the tensors (a CUDA graph
        keeps the values it was captured with). Providers that read the tensors ignore it.

        ``sinks``: passed only for ``config.sinks``: ``[Hq]`` sink logits (float32 or the model dtype) on
        the device, read there; each row's softmax counts its head's sink once (``lse`` includes it). A
        provider without :attr:`NATIVE_SINKS` passes it on to :meth:`run_folded`."""

    def run_folded(
        self,
        plan: Plan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        sinks: torch.Tensor,
        **scales,
    ) -> None:
        """The default sink path: :meth:`run` without the sink into ``out`` and the LSE (``lse``, or a
        ``[T, Hq]`` float32 temporary), then :func:`~attnplug.core.kernels.merge.apply_sinks` joins the
        sink in place: ``out *= sigmoid(lse - sink)``, ``lse = logaddexp(lse, sink)`` (exact)."""
        from ..kernels.merge import apply_sinks  # noqa: PLC0415 - triton is imported only where sinks run

        if lse is not None:
            self.run(plan, q, k_cache, v_cache, out, lse, **scales)
            s = lse
        else:
            s = self.run_lse(
                plan,
                q,
                k_cache,
                v_cache,
                out,
                torch.empty(out.shape[:2], dtype=torch.float32, device=out.device),
                **scales,
            )
        apply_sinks(out, s, sinks)

    def run_lse(
        self,
        plan: Plan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        **scales: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`run` for a caller that reads the LSE once, right after (the cascade's merges): returns the
        natural-log LSE ``[T, Hq]`` float32, any strides. Default: ``lse`` itself, written by :meth:`run`. A
        provider whose library hands back an LSE of its own may return a view of it instead of copying it
        into ``lse`` (valid until its next run; captured in a CUDA graph, at every replay)."""
        self.run(plan, q, k_cache, v_cache, out, lse, **scales)
        return lse

    def run_merge(
        self,
        plan: Plan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scratch_out: torch.Tensor,
        scratch_lse: torch.Tensor,
        **scales: torch.Tensor,
    ) -> None:
        """Merge attention of ``q [T, Hq, D]`` over this plan's keys into the state ``out [T, Hq, D]``,
        ``lse [T, Hq]`` (float32, natural log), which holds attention over a disjoint key set (the
        cascade's prefix part). Rows with no key in the plan leave ``out`` / ``lse`` untouched. No
        host work. Default: :meth:`run_lse` into ``scratch_out [T, Hq, D]`` / ``scratch_lse [T, Hq]``,
        then the core's in-place :func:`~attnplug.core.kernels.merge.merge_state`. ``sinks`` (in
        ``scales``): joins the merged state once, after the merge (every row, keys in this plan or not)."""
        from ..kernels.merge import apply_sinks, merge_state  # noqa: PLC0415 - triton: where cascade runs

        sinks = scales.pop("sinks", None)
        s_b = self.run_lse(plan, q, k_cache, v_cache, scratch_out, scratch_lse, **scales)
        merge_state(out, lse, scratch_out, s_b, out, lse)
        if sinks is not None:
            apply_sinks(out, lse, sinks)

    # -- static memory, graphs, drafts ----------------------------------------------------------------
    def static_buffers(
        self,
        max_rows: int,
        max_tokens: int,
        max_kv_len: int,
        q: int = 1,
        num_kv_splits: int | None = None,
        noncausal: bool = False,
    ) -> ProviderStatic | None:
        """Storage for plans of up to ``max_rows`` requests / ``max_tokens`` query tokens, each with
        ``q`` tokens and at most ``max_kv_len`` keys, passed back to :meth:`plan` as ``static``
        (``noncausal``: for a cascade graph's prefix part, whose split counts may differ). Default: ``None``
        (the provider's plan holds no memory of its own)."""
        return None

    def fixed_tile_options(self, plan: Plan) -> tuple[dict, int | None]:
        """Plan options that fix the tile shape of ``plan`` (the largest batch of a graph part) for its
        smaller batches too, so that their tile lists are prefixes of one list in static memory, and
        the query rows of one such tile. Default ``({}, None)``: this provider has no tile knobs."""
        return {}, None

    def graph_tile_list(
        self, plan: Plan, static: ProviderStatic | None, max_tiles: Callable[[int], int]
    ) -> GraphTiles | None:
        """Plan ``plan`` (a cascade graph's prefix part, :class:`~attnplug.core.cascade.CascadeGraph`:
        its slots' query rows and keys change at every replay, its host twins only size it) into
        ``static`` with a tile list of ``max_tiles(block_q)`` entries the caller rewrites on the device
        before each replay (:class:`GraphTiles`); ``None``: its launches read the device lengths only (no
        tile list). Default: refused (a plan fixed at capture would not follow the groups)."""
        raise self.unsupported("the prefix part of cascade CUDA graphs (groups that change at every replay)")

    def graph(self, gs: GraphState) -> ProviderGraph:
        """This provider's part of ``gs`` (raises :class:`UnsupportedFeature` when
        :attr:`graph_support` cannot serve ``gs.mode``)."""
        g = self.graph_support
        if not (g.decode if gs.mode == "decode" else g.verify):
            raise self.unsupported(f"CUDA graphs of {gs.mode} batches ({g.reason})")
        if getattr(gs, "chain", False) and self.chain_graph_cls is not None:
            return self.chain_graph_cls(self, gs)
        return self.graph_cls(self, gs)

    def fork(self) -> Provider:
        """An instance whose plans stay valid beside this one's, sharing its heavy resources (e.g. a
        library workspace): for graph families, cascade parts and draft steps. Default: this one (its
        plans live in the ``Plan`` objects)."""
        return self

    def graph_prefix_provider(self) -> Provider:
        """The provider that runs the shared-prefix part of this provider's cascade graphs
        (:class:`~attnplug.core.cascade.CascadeGraph`: a non-causal plan of one slot a group over static device
        lengths, :meth:`run_merge` into the suffix state). Default: a fork of this one."""
        return self.fork()

    def step_providers(self, num_steps: int) -> list[Provider]:
        """Providers for ``num_steps`` draft steps whose plans must all stay valid at once: this one,
        then forks of it (:meth:`fork`)."""
        return [self] + [self.fork() for _ in range(num_steps - 1)]


def _load_impl(spec: str | None) -> type | None:
    """The class a ``"module:Class"`` spec (relative to this package) names; ``None`` for ``None``."""
    if spec is None:
        return None
    import importlib  # noqa: PLC0415

    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod, __package__), name)


class RaggedKernel(ABC):
    """One provider's cache-free prefill (:class:`~attnplug.core.ragged.RaggedAttention`): :meth:`refusal`
    (no device), :meth:`plan` (host work once per forward, into ``plan.state``), :meth:`run` (per layer)."""

    def __init__(self, config: RaggedConfig, device: torch.device):
        self.config = config
        self.device = device

    #: A library kernel's limits (``None``: none declared): its name, the head dims it runs with ``Dv = D``,
    #: and its extra ``(D, Dv)`` pairs; 16-bit inputs only.
    LIBRARY: ClassVar[str | None] = None
    HEAD_DIMS: ClassVar[tuple[int, ...]] = ()
    DIM_PAIRS: ClassVar[tuple[tuple[int, int], ...]] = ()

    @classmethod
    def refusal(cls, config: RaggedConfig) -> str | None:
        """What of ``config`` it cannot run, for attnplug's refusal; ``None``: it can. Default: the declared
        :attr:`LIBRARY` limits."""
        if cls.LIBRARY is None:
            return None
        if config.dtype not in (torch.float16, torch.bfloat16):
            return f"ragged prefill in {config.dtype} ({cls.LIBRARY} runs float16/bfloat16)"
        d, dv = config.head_dim, config.head_dim_v
        if (d, dv) not in cls.DIM_PAIRS and not (d == dv and d in cls.HEAD_DIMS):
            pairs = "".join(f", or {a}/{b}" for a, b in cls.DIM_PAIRS)
            return f"ragged prefill with head dims {d}/{dv} ({cls.LIBRARY}: {cls.HEAD_DIMS} with equal v{pairs})"
        return None

    def plan(self, plan: RaggedPlan) -> None:
        """Host work of one forward (default: none; the kernels read ``plan.cu_q`` / ``plan.cu_k``)."""

    @abstractmethod
    def run(self, plan: RaggedPlan, q, k, v, out: torch.Tensor) -> None:
        """``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` -> writes ``out [Tq, Hq, Dv]``."""
