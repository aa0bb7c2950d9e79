"""The ``triton`` provider: attnplug's own kernels (:mod:`attnplug.core.kernels`).

``plan`` picks block sizes and the split count, builds the tile list on the host once and keeps
the split workspace; ``run`` only launches (one kernel, plus the merge when split).
On a machine without CUDA it runs on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).
fp8 KV caches (e4m3 / e5m2) are dequantized on load inside the kernel, every mode. Attention sinks
(``config.sinks``) join every kernel's softmax natively: unsplit programs start their state at the
sink, split partials carry none and the merge (fused or not) adds it once. On an sm90 GPU with Gluon
(:func:`gluon_sm90`) causal 16-bit page-16 prefill / extend runs the Gluon kernel
(:mod:`attnplug.core.kernels.gluon_prefill`), chosen at plan time (:meth:`TritonProvider._gluon_config`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import graph_if, staging
from ..config import FP8_KV_DTYPES, SUPPORTED_DTYPES, AttentionConfig, env_flag
from ..kernels import tiles as tile_table
from ..pages import num_pages
from ..plan import Plan, PlanOptions, ProviderState, ProviderStatic
from . import triton_interp
from .base import GraphSupport, GraphTiles, Provider, ProviderGraph, RaggedKernel

logger = logging.getLogger("attnplug")


@dataclass(frozen=True)
class TritonOptions(PlanOptions):
    """The triton provider's plan knobs (``PagedAttention.plan(batch, **knobs)``; ``None``: its default).

    Attributes:
        num_kv_splits: split-KV chunks per tile (default: from the SM count and ``max_kv_len``).
        block_m, block_n, num_warps, num_stages: tile rows (query rows x GQA heads), keys per block,
            warps, pipeline stages.
        kv_start: ``[B]`` int32 on the device; request ``b`` attends only to keys at positions
            ``>= kv_start[b]`` (the fa3 provider's tree part).
    """

    num_kv_splits: int | None = None
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    kv_start: torch.Tensor | None = None


@dataclass
class TritonState(ProviderState):
    """Per-forward launch arguments (``plan.state``, built in ``plan``)."""

    tile_req: torch.Tensor  # [num_tiles] int32, request of each tile
    tile_qstart: torch.Tensor  # [num_tiles] int32, first query token of the tile within its request
    num_tiles: int
    num_splits: int
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    partial: torch.Tensor | None  # [T, Hq, S, D] float32 (or the output dtype: entry 'partials') when split
    partial_lse: torch.Tensor | None  # [T, Hq, S] float32 (base-2) when split
    kv_start: torch.Tensor | None  # [B] int32: attend only to keys >= kv_start[b]
    # "paged" (kernels.attention), "prefill" (kernels.prefill), "decode" (kernels.decode), "gluon"
    # (kernels.gluon_prefill: causal prefill on sm90 where Gluon is present)
    kernel: str = "paged"
    diag_n: int = 0  # prefill: keys per block of the masked diagonal loop
    tma: bool = False  # prefill: K/V through tensor descriptors (page size a multiple of block_n)
    counters: torch.Tensor | None = None  # decode with fused merge: [B * Hkv] int32, zero between launches
    fp8_f16: bool = False  # fp8 KV: fp16 dots on a pre-scaled query (tile-table field)
    pairs: bool = False  # fp8 KV, decode kernel: K/V read as 16-bit byte pairs (tile-table field)
    qk_ahead: bool = False  # gluon: the next block's Q K^T issued before this block's softmax
    loaders: int = 0  # gluon: gather warps of the warp-specialized kernel (0: the single-partition kernel)
    pingpong: bool = False  # gluon, warp-specialized: the compute warpgroups take turns at the wgmmas
    # a cascade graph's prefix part on the prefill kernel: [1] int32, the tiles the graph update wrote (only the
    # groups it cut), which grid_tiles programs a KV head and split stride over
    tile_count: torch.Tensor | None = None
    grid_tiles: int = 0


@dataclass
class TritonStatic(ProviderStatic):
    """Static memory of triton plans (:meth:`TritonProvider.static_buffers`): the tile list is copied
    into ``tile_req`` / ``tile_qstart`` (the first ``identity_rows`` entries already hold the decode
    tile list ``arange / 0``, so single-token plans copy nothing); split partials are views of
    ``partial`` / ``partial_lse``."""

    tile_req: torch.Tensor  # [max_tiles] int32
    tile_qstart: torch.Tensor  # [max_tiles] int32
    partial: torch.Tensor  # [n * D] float32
    partial_lse: torch.Tensor  # [n] float32
    identity_rows: int
    counters: torch.Tensor | None = None  # [max_rows * Hkv] int32 zeros: the decode kernel's fused merge
    tile_count: torch.Tensor | None = None  # [1] int32: a cascade prefix part's tiles (graph_tile_list)


def triton_interpreter_active() -> bool:
    """True when triton in this process runs interpreted (``TRITON_INTERPRET=1`` was set before triton
    was first imported; a later setting leaves triton's own library functions compiled)."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # another triton layout: trust the variable
        return os.environ.get("TRITON_INTERPRET") == "1"
    return isinstance(tl.standard.sigmoid, InterpretedFunction)


def triton_runs_on(t: torch.Tensor) -> bool:
    """attnplug's Triton kernels can run on ``t``'s device: CUDA, or the CPU under the Triton interpreter."""
    return t.is_cuda or triton_interpreter_active()


def _stable_order(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` for ``[n]`` int keys, faster: keys in ``[0, 2**16)`` as uint16
    (numpy's stable sort of 16-bit keys is a radix sort); other non-negative keys through one plain
    sort of ``key << 32 | position`` (unique values, so any sort keeps equal keys in position order)."""
    n = key.shape[0]
    if n and key.dtype in (np.int32, np.int64):
        u = key.view(np.uint32 if key.dtype == np.int32 else np.uint64)  # a negative key reads as >= 2**31
        if u[u.argmax()] < 1 << 16:
            return key.astype(np.uint16).argsort(kind="stable")
    if n >= 1 << 32 or (n and int(key[key.argmin()]) < 0):
        return np.argsort(key, kind="stable")
    packed = (key.astype(np.int64) << 32) | np.arange(n, dtype=np.int64)
    packed.sort()
    return packed & 0xFFFFFFFF


def _tile_counts(q_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Tiles of ``block_q`` query tokens per request: ``counts [B]`` (``ceil(q_len / block_q)``, 0 for
    ``q_len = 0``) and their running sum ``ends [B]`` int32 (``ends[-1]``: the number of tiles)."""
    counts = (q_lens - 1) // block_q + 1  # no overflow near the int32 limit
    return counts, counts.cumsum(dtype=np.int32)


def _tiling(q_lens: np.ndarray, block_q: int) -> tuple[bool, np.ndarray | None, np.ndarray | None, int]:
    """``(identity, counts, ends, num_tiles)`` of tiles of ``block_q`` tokens over ``q_lens [B]``:
    ``identity`` when each request is one tile from token 0 (decode, short verify: the list is arange /
    zeros; ``counts`` / ``ends`` then ``None``), else :func:`_tile_counts`."""
    nreq = q_lens.shape[0]
    if nreq == 0 or (q_lens[q_lens.argmin()] >= 1 and q_lens[q_lens.argmax()] <= block_q):
        return True, None, None, nreq
    counts, ends = _tile_counts(q_lens, block_q)
    return False, counts, ends, int(ends[-1])


def _tile_list(
    q_lens: np.ndarray, kv_lens: np.ndarray, counts: np.ndarray, ends: np.ndarray, block_q: int, ascending_work: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The tile list: ``tile_req [T]`` int32 (request of each tile) and ``tile_q [T]`` int32 (its first
    query token), ``T = ends[-1]``, from :func:`_tile_counts` of at least one request. In request order, tiles in
    token order;
    ``ascending_work``: sorted by ``kv_len - q_len + tile_q`` (the causal keys of the tile's first
    row), ties in that order (a stable sort)."""
    tile_req = np.arange(q_lens.shape[0], dtype=np.int32).repeat(counts)
    tile_q = (np.arange(int(ends[-1]), dtype=np.int32) - (ends - counts).repeat(counts)) * block_q
    tile_q = tile_q.astype(np.int32, copy=False)
    if ascending_work:
        order = _stable_order((kv_lens - q_lens)[tile_req] + tile_q)
        tile_req, tile_q = tile_req[order], tile_q[order]
    return tile_req, tile_q


# a full decode batch of more than this many programs an SM (``B * Hkv``) reads the ``decode_wide``
# entry: beyond one wave of four programs an SM (deep one-warp pipelines stop paying off there:
# docs/measured-choices.md)
_WIDE_PROGRAMS_PER_SM = 4


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _even(cache: torch.Tensor, strides) -> bool:
    """An fp8 cache the decode kernel may read as 16-bit words (``pairs``): even address and strides."""
    return cache.data_ptr() % 2 == 0 and not any(x % 2 for x in strides)


def _aligned16(t: torch.Tensor, strides) -> bool:
    """A 16-bit tensor the Gluon prefill kernel may copy in 16-byte pieces: 16-byte aligned, strides of 8."""
    return t.data_ptr() % 16 == 0 and not any(x % 8 for x in strides)


# the Triton releases whose Gluon API the Gluon kernels are written and compile-checked
# (tests/core/sm90_aot.py) for
GLUON_TRITON = ((3, 6), (3, 8))
GLUON_ENV = "ATTNPLUG_GLUON"  # on by default; 0 / off: the Triton kernels (docs/gluon.md)


def gluon_wanted() -> bool:
    """``ATTNPLUG_GLUON``: unset or ``1`` (the default) lets the triton provider plan the Gluon prefill
    kernel where :func:`gluon_sm90` finds it can run; ``0`` keeps the Triton kernels everywhere."""
    return env_flag(GLUON_ENV, True)


def gluon_sm90(device: torch.device) -> bool:
    """Whether the Gluon prefill kernel (:mod:`attnplug.core.kernels.gluon_prefill`) runs on ``device``:
    a CUDA sm90 GPU (compute capability 9.0) without the Triton interpreter, with a triton in
    :data:`GLUON_TRITON` whose ``triton.experimental.gluon`` imports, unless ``ATTNPLUG_GLUON=0``
    (:func:`gluon_wanted`)."""
    if device.type != "cuda" or triton_interpreter_active() or not gluon_wanted():
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        import triton

        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
        if not GLUON_TRITON[0] <= version <= GLUON_TRITON[1]:
            return False
        from ..kernels import gluon_prefill  # noqa: F401
    except Exception as e:  # ImportError, or a Gluon API this kernel does not know
        logger.info("attnplug: provider 'triton': Gluon prefill kernel unavailable (%r)", e)
        return False
    return True


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonGraph(ProviderGraph):
    """Triton under CUDA graphs: the split count of each batch size is fixed at capture (the
    heuristic at ``max_seq_len``, or ``num_kv_splits``); tiles and split partials are static."""

    def __init__(self, provider: TritonProvider, gs):
        super().__init__(provider, gs)
        self.splits = {
            bs: provider.split_count(bs, gs.max_seq_len, gs.num_kv_splits) for bs in range(1, gs.max_batch + 1)
        }

    def plan(self, plan: Plan, bs: int) -> None:
        plan.options = dataclasses.replace(TritonOptions.of(plan.options), num_kv_splits=self.splits[bs])
        self.provider.plan(plan, static=self.static)


class TritonProvider(Provider):
    name = "triton"
    Options = TritonOptions
    graph_support = GraphSupport(decode=True, verify=True, device_refresh=True, cascade=True)
    graph_cls = TritonGraph
    KV_DTYPES = frozenset(SUPPORTED_DTYPES + FP8_KV_DTYPES)
    NATIVE_SINKS = True
    MLA_IMPL = ".triton_mla:TritonMLAProvider"
    RAGGED_IMPL = ".triton:TritonRagged"

    @classmethod
    def prepare_process(cls, device_type: str) -> None:
        """On CPU the kernels run through the Triton interpreter, which triton reads when it is first
        imported: set ``TRITON_INTERPRET=1`` for this process (if triton is not imported yet) and the
        engine processes it spawns (a user's own setting wins). Too late for a process that already
        imported triton: :meth:`check_available` then says so."""
        if device_type == "cpu" and "TRITON_INTERPRET" not in os.environ:
            os.environ["TRITON_INTERPRET"] = "1"
            logger.info("attnplug: provider 'triton' on CPU: TRITON_INTERPRET=1 (Triton interpreter)")

    @classmethod
    def preferred_kv_layout(cls, kv_dtype: torch.dtype | None) -> str | None:
        """``"HND"`` for an fp8 cache: a decode program reads one KV head, whose ``P`` keys of a page
        are then one contiguous ``P * D``-byte run instead of ``P`` runs of ``D`` bytes ``Hkv * D`` apart
        (measured: ``docs/measured-choices.md``)."""
        return "HND" if kv_dtype in FP8_KV_DTYPES else None

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise cls.unavailable(f"it does not run on device {device}")
        try:
            import triton
        except Exception as e:  # ImportError, or a broken install
            raise cls.unavailable(f"import triton failed: {e!r}") from e
        if device.type == "cpu":
            if not triton_interpreter_active():
                raise cls.unavailable(
                    "on CPU it needs the Triton interpreter, but triton was imported in compiled mode: "
                    "TRITON_INTERPRET=1 must be set before anything imports triton (the engine adapters "
                    "set it in the launcher when an attnplug triton backend is selected on CPU)"
                )
            if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
                raise cls.unavailable(
                    f"on CPU it needs triton >= 3.7 (its interpreter handles scalar loop "
                    f"bounds); found triton {triton.__version__}"
                )
            if triton_interp.install():
                logger.debug("attnplug: triton %s interpreter: nested patches memoized per launch", triton.__version__)

    def check_config(self, config: AttentionConfig) -> None:
        if config.head_dim > 256:
            raise self.unsupported(f"head_dim {config.head_dim} (max 256)")
        if config.head_dim < 16:
            raise self.unsupported(f"head_dim {config.head_dim} (min 16)")
        self._sms = _num_sms(self.device)
        self._gluon = gluon_sm90(self.device)
        self._pdl_ok: bool | None = None
        self._entry_keys: dict[str, tuple[str, ...]] = {}

    # -- plan -------------------------------------------------------------------------------------
    def _place_tiles(
        self,
        plan: Plan,
        static: TritonStatic | None,
        identity: bool,
        num_tiles: int,
        counts,
        ends,
        block_q: int,
        ascending_work: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tile list (``tile_req``, ``tile_qstart`` int32 on the device) of ``num_tiles`` tiles of
        ``block_q`` tokens (:func:`_tile_counts`'s ``counts`` / ``ends``; ``identity``: one tile a request,
        the ``arange`` / ``zeros`` list): views of the static decode list or the provider's identity
        buffers where they serve, else built on the host and copied (into ``static`` when given).
        ``ascending_work``: sorted by causal work (:func:`_tile_list`)."""
        if static is not None and identity and num_tiles <= static.identity_rows:
            return static.tile_req[:num_tiles], static.tile_qstart[:num_tiles]
        if static is None and identity:
            return self._identity_tiles(num_tiles)
        if identity:
            tile_req, tile_q = np.arange(num_tiles, dtype=np.int32), np.zeros(num_tiles, dtype=np.int32)
        else:  # prefill: ascending causal work, the kernel runs the list backwards, longest first
            tile_req, tile_q = _tile_list(
                plan.q_lens_cpu.numpy(), plan.kv_lens_cpu.numpy(), counts, ends, block_q, ascending_work
            )
        if static is None:
            return staging.to_device((tile_req, tile_q), self.device)
        if num_tiles > static.tile_req.numel():
            raise ValueError(f"attnplug: {num_tiles} triton tiles exceed the static capacity {static.tile_req.numel()}")
        static.identity_rows = 0  # the decode tile list is overwritten
        return (
            static.tile_req[:num_tiles].copy_(torch.from_numpy(tile_req), non_blocking=True),
            static.tile_qstart[:num_tiles].copy_(torch.from_numpy(tile_q), non_blocking=True),
        )

    def _identity_tiles(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``arange(n)`` / ``zeros(n)`` int32 on the device, the tile list of single-tile requests:
        views of two buffers kept per provider (grown by doubling), cached per ``n`` (read-only
        kernel arguments; no tensor is made per plan)."""
        tiles = getattr(self, "_tiles", None)
        if tiles is None:
            tiles = self._tiles = {}
        views = tiles.get(n)
        if views is None:
            iota = getattr(self, "_iota", None)
            if iota is None or iota[0].numel() < n:
                cap = max(64, 1 << max(0, n - 1).bit_length())
                iota = self._iota = (
                    torch.arange(cap, dtype=torch.int32, device=self.device),
                    torch.zeros(cap, dtype=torch.int32, device=self.device),
                )
                tiles.clear()
            views = tiles[n] = (iota[0][:n], iota[1][:n])
        return views

    def _entry(self, bucket: str) -> tile_table.TileEntry:
        """This config's tile-table entry for ``bucket`` (:mod:`attnplug.core.kernels.tiles`)."""
        keys = self._entry_keys.get(bucket)
        if keys is None:  # the keys are fixed by the config; the table is read on every call
            cfg = self.config
            keys = self._entry_keys[bucket] = tile_table.lookup_keys(
                cfg.head_dim, cfg.group_size, bucket, cfg.kv_quantized
            )
        return tile_table.first_entry(tile_table.TILES, keys)

    def _decode_bucket(self, programs: int) -> str:
        """Decode bucket of a batch with ``programs = B * Hkv`` programs before any split."""
        if programs >= self._sms:
            return self._full_bucket(programs)
        return "decode_split" if programs >= 16 else "decode_tiny"

    def _full_bucket(self, programs: int) -> str:
        """The bucket of an unsplit decode batch of ``programs = B * Hkv`` programs (its tiles)."""
        return "decode_wide" if programs > _WIDE_PROGRAMS_PER_SM * self._sms else "decode"

    def _blocks(self, plan: Plan) -> tuple[int, int, int, int, int]:
        """(block_q, block_m, block_n, num_warps, num_stages) for this batch, from the tile table
        (:mod:`attnplug.core.kernels.tiles`, measured by ``benchmarks/sweep_triton.py``); decode
        batches that split refine theirs in :meth:`plan` once the split count is known."""
        cfg = self.config
        g = cfg.group_size
        if plan.max_q_len <= 1:  # decode: BLOCK_Q = 1, the GQA group fills the rows
            e = self._entry(self._full_bucket(plan.batch_size * cfg.num_kv_heads))
            return 1, max(16, _next_pow2(g)), e.block_n or 128, e.num_warps or 4, e.num_stages or 3
        e = self._entry("prefill")
        if not plan.causal and plan.mask is None:  # cascade prefix parts: the paged kernel, split-KV
            e = self._entry("noncausal") or e
        block_m = max(e.block_m or 128, _next_pow2(g))
        bucket = "verify" if plan.mask is not None else "prefill"
        if plan.max_q_len * g < block_m:  # short queries (small verify trees / extends)
            block_m = max(16, _next_pow2(plan.max_q_len * g))
            bucket = "verify" if plan.mask is not None else "short"
        if bucket != "prefill":
            e = self._entry(bucket)
            if bucket == "verify" and plan.max_q_len * g >= (e.block_m or block_m):
                block_m = max(e.block_m or block_m, _next_pow2(g))
        block_q = max(1, block_m // g)
        return block_q, block_m, e.block_n or 32, e.num_warps or 4, e.num_stages or 3

    def _prefill_kernel_ok(self, plan: Plan, entry: tile_table.TileEntry, block_m: int, splits: int) -> bool:
        """The prefill kernel computes this batch: ``entry`` (the batch's tile entry) names it and the
        tile is the entry's, no custom mask / window / soft cap / ``kv_start``, queries that fill the
        tiles; causal without split, or non-causal (a cascade prefix part, split or not) with a 16-bit KV
        cache (fp8 caches keep the paged kernel there, the one measured for them)."""
        cfg = self.config
        return (
            entry.kernel == "prefill"
            and block_m == max(entry.block_m or 128, _next_pow2(cfg.group_size))
            and plan.mask is None
            and cfg.window_left < 0
            and cfg.logits_soft_cap <= 0
            and TritonOptions.of(plan.options).kv_start is None
            and plan.max_q_len > 1
            and (splits == 1 if plan.causal else not cfg.kv_quantized)
        )

    def _gluon_config(self, plan: Plan) -> tuple[int, int, int, int, bool, int, bool] | None:
        """``(block_m, block_n, num_stages, num_warps, qk_ahead, loaders, pingpong)`` of the Gluon prefill kernel
        (:mod:`..kernels.gluon_prefill`'s ``CONFIGS``) where it computes this batch: an sm90 GPU with
        Gluon (:func:`gluon_sm90`), causal queries that fill its ``block_m``-row tiles, 16-bit KV in pages
        of 16, a head dim the table has (64 / 128), a power-of-two GQA group, no custom mask, window, soft cap, sinks,
        ``kv_start`` or forced tiles / splits; else None (the Triton kernels)."""
        cfg, o = self.config, TritonOptions.of(plan.options)
        if not (
            self._gluon
            and plan.causal
            and plan.mask is None
            and plan.max_q_len > 1
            and cfg.page_size == 16
            and not cfg.kv_quantized
            and cfg.dtype in (torch.bfloat16, torch.float16)
            and cfg.window_left < 0
            and cfg.logits_soft_cap <= 0
            and not cfg.sinks
            and cfg.group_size == _next_pow2(cfg.group_size)
        ):
            return None
        forced = (o.kv_start, o.block_m, o.block_n, o.num_warps, o.num_stages, o.num_kv_splits)
        if any(x is not None for x in forced):
            return None
        from ..kernels.gluon_prefill import CONFIGS

        c = CONFIGS.get(cfg.head_dim)
        return c if c is not None and cfg.group_size <= c[0] <= plan.max_q_len * cfg.group_size else None

    def takes_split_count(self) -> bool:
        """Yes: ``num_kv_splits`` (:class:`TritonOptions`) forces the split count."""
        return True

    def split_count(self, num_tiles: int, max_kv_len: int, forced: int | None = None, noncausal: bool = False) -> int:
        """Split-KV chunks per tile: ``forced``, else (when ``num_tiles * Hkv`` programs do not fill the
        SMs, or fill them but their ``decode`` entry names a ``ctas_per_sm``, and ``max_kv_len >= 1024``)
        enough programs for the table's ``ctas_per_sm`` per SM (seed:
        2, 4 for fewer than 16 programs; an entry with ``whole_waves``: at most that many, so that no
        program waits for a slot, or one more an SM where that would leave a fifth of them idle), at
        most ``max_splits`` (64) and one per ``min_split_keys``
        keys (default 128 for ``decode_tiny`` and 16-bit ``decode_split`` batches, 512 for fp8
        ``decode_split``: ``docs/measured-choices.md``).
        ``noncausal`` (the cascade's prefix parts: tiles of equal work, on the paged or the prefill
        kernel): ``ctas_per_sm`` and ``min_split_keys`` from the ``noncausal`` entry when it names them
        (else the bucket's ``ctas_per_sm`` and the default keys), and at most that many
        programs per SM (rounded down), so that no tail wave runs a few tiles after the rest."""
        if forced is not None:
            return max(1, int(forced))
        programs = num_tiles * self.config.num_kv_heads
        bucket = self._decode_bucket(programs)
        e = self._entry(bucket)
        if max_kv_len < 1024 or (programs >= self._sms and e.ctas_per_sm is None):  # a full batch
            return 1
        min_keys = 512 if bucket == "decode_split" and self.config.kv_quantized else 128
        by_len = max_kv_len // (e.min_split_keys or min_keys)
        ctas = e.ctas_per_sm or (2 if programs >= 16 else 4)
        if noncausal:  # the noncausal entry's own keys a split (the decode entry's are for decode kernels)
            ne = self._entry("noncausal")
            ctas, by_len = ne.ctas_per_sm or ctas, max_kv_len // (ne.min_split_keys or min_keys)
            return max(1, min(e.max_splits or 64, by_len, ctas * self._sms // max(programs, 1)))
        slots, programs = ctas * self._sms, max(programs, 1)
        if e.whole_waves:
            per = slots // programs
            if 5 * per * programs < 4 * slots:  # a fifth of the slots idle: whole waves of one program more an SM
                per = (slots + self._sms) // programs
        else:
            per = num_pages(slots, programs)
        return max(1, min(e.max_splits or 64, by_len, per))

    def fixed_tile_options(self, plan: Plan) -> tuple[dict, int | None]:
        """``block_m`` of ``plan``'s tiles (planned here), and their query rows ``block_q``."""
        self.plan(plan)
        st: TritonState = plan.state
        return {"block_m": st.block_m}, st.block_q

    def graph_tile_list(self, plan: Plan, static: TritonStatic | None, max_tiles: Callable[[int], int]) -> GraphTiles:
        """The plan's tiles as a list of ``max_tiles(block_q)`` entries in ``static`` that the caller
        writes before each launch (its split count stays the one of the host twins' tiling; merge
        counters for every tile). MLA plans too (their state has the same tile fields). On the prefill
        kernel, which merges into the suffix state in its launch, only the cut groups get tiles: their
        count on the device, and a grid of ``grid_tiles`` programs a KV head and split that stride over
        them (the host twins' tile count, or more while they fit the SMs in one wave), so that a replay that
        cut nothing costs one wave of programs that read the count."""
        self.plan(plan, static=static)
        a: TritonState = plan.state
        n = max_tiles(a.block_q)
        if n > static.tile_req.numel():
            raise ValueError(f"attnplug: {n} triton tiles exceed the static capacity {static.tile_req.numel()}")
        static.identity_rows = 0  # the list is the caller's now
        fields = dict(tile_req=static.tile_req[:n], tile_qstart=static.tile_qstart[:n], num_tiles=n)
        if getattr(a, "counters", None) is not None:  # the in-kernel merge's: one a (tile, KV head)
            need = n * self.config.num_kv_heads
            if static.counters is None or static.counters.numel() < need:
                static.counters = torch.zeros(need, dtype=torch.int32, device=self.device)
            fields["counters"] = static.counters[:need]
        if _merges_in_kernel(a) and not plan.causal:
            if static.tile_count is None:
                static.tile_count = torch.zeros(1, dtype=torch.int32, device=self.device)
            wave = self._sms // (self.config.num_kv_heads * a.num_splits)  # programs that fit the SMs at once
            fields.update(tile_count=static.tile_count, grid_tiles=max(1, min(n, max(a.num_tiles, wave))))
        plan.state = dataclasses.replace(a, **fields)
        return GraphTiles(plan.state.tile_req, plan.state.tile_qstart, a.block_q, fields.get("tile_count"))

    def static_buffers(
        self,
        max_rows: int,
        max_tokens: int,
        max_kv_len: int,
        q: int = 1,
        num_kv_splits: int | None = None,
        noncausal: bool = False,
    ) -> TritonStatic:
        """Tiles for ``max_tokens`` rows (the first ``max_rows`` hold the decode tile list) and split
        partials for the largest ``rows * q * splits(rows)`` over ``rows <= max_rows`` (none when
        every batch runs unsplit)."""
        cfg, dev = self.config, self.device
        splits = (self.split_count(r, max_kv_len, num_kv_splits, noncausal) for r in range(1, max_rows + 1))
        n = max((r * q * s for r, s in enumerate(splits, 1) if s > 1), default=0) * cfg.num_qo_heads
        return TritonStatic(
            tile_req=torch.arange(max(max_tokens, max_rows), dtype=torch.int32, device=dev),
            tile_qstart=torch.zeros(max(max_tokens, max_rows), dtype=torch.int32, device=dev),
            partial=torch.empty(n * cfg.head_dim, dtype=torch.float32, device=dev),
            partial_lse=torch.empty(n, dtype=torch.float32, device=dev),
            identity_rows=max_rows,
            counters=torch.zeros(max_rows * cfg.num_kv_heads, dtype=torch.int32, device=dev),
        )

    def plan(self, plan: Plan, static: TritonStatic | None = None) -> None:
        """Block sizes, the tile list (host, once) and the split count; knobs from ``plan.options``.
        With ``static`` the tile list and the split partials live in its memory."""
        cfg, o = self.config, TritonOptions.of(plan.options)
        block_q, block_m, block_n, warps, stages = self._blocks(plan)
        blocks = block_q, block_m, block_n, warps, stages
        gluon = self._gluon_config(plan) if self._gluon else None
        if gluon is not None:
            block_m, block_n, stages, warps = gluon[:4]
            block_q = block_m // cfg.group_size
        if o.block_m is not None:
            block_m, block_q = o.block_m, max(1, o.block_m // cfg.group_size)
        block_n = o.block_n or block_n
        warps, stages = o.num_warps or warps, o.num_stages or stages
        # tile list on the host in numpy (a handful of vector ops, no per-request Python)
        q_lens = plan.q_lens_cpu.numpy()
        noncausal = plan.max_q_len > 1 and not plan.causal and plan.mask is None
        while True:
            identity, counts, ends, num_tiles = _tiling(q_lens, block_q)
            splits = self.split_count(num_tiles, plan.max_kv_len, o.num_kv_splits, noncausal)
            if gluon is None or splits == 1:
                break
            # too few tiles to fill the GPU: the Triton kernels' blocks and split plan
            gluon, (block_q, block_m, block_n, warps, stages) = None, blocks
        kernel, entry = "paged", self._entry("prefill")
        if plan.max_q_len <= 1:
            programs = num_tiles * cfg.num_kv_heads
            entry = self._entry(self._full_bucket(programs) if splits == 1 else self._decode_bucket(programs))
            if splits > 1:  # the split bucket's tiles (seed rule: below small_tiles_from_splits, decode_split's)
                e = entry if splits >= entry.small_tiles_from_splits else self._entry("decode_split")
                block_n = o.block_n or e.block_n or block_n
                warps, stages = o.num_warps or e.num_warps or warps, o.num_stages or e.num_stages or stages
            if entry.kernel == "decode" and plan.mask is None and o.kv_start is None and block_n >= 16:
                kernel = "decode"
        else:  # the prefill kernel where the batch's entry names it (cascade prefix parts: the noncausal one)
            pe = self._entry("noncausal") if noncausal else entry
            if gluon is not None:
                kernel = "gluon"
            elif self._prefill_kernel_ok(plan, pe, block_m, splits):
                # the entry's launch shape: a pinned block_m (cascade graphs' prefix parts) may come with the
                # knobs of a shorter batch's bucket
                kernel, entry = "prefill", pe
                block_n = o.block_n or pe.block_n or block_n
                warps, stages = o.num_warps or pe.num_warps or warps, o.num_stages or pe.num_stages or stages
        fused = kernel == "decode" and splits > 1 and entry.fused_merge
        # a split non-causal prefill plan in static memory (a cascade graph's prefix part): counters for
        # run_merge's in-kernel merge into the suffix state
        fused = fused or (kernel == "prefill" and noncausal and splits > 1 and static is not None)
        diag_n = min(block_n, entry.diag_n or block_n) if kernel == "prefill" else 0
        tma = (
            kernel == "prefill"
            and entry.tma
            and cfg.page_size % block_n == 0
            and cfg.head_dim == _next_pow2(cfg.head_dim)
            and diag_n == block_n
        )
        shape = (plan.num_tokens, cfg.num_qo_heads, splits, cfg.head_dim)
        partial = partial_lse = None
        tile_req, tile_q = self._place_tiles(
            plan, static, identity, num_tiles, counts, ends, block_q, kernel in ("prefill", "gluon")
        )
        # the prefill kernel's split partials in the output dtype where its entry says so (half the bytes)
        pdt = cfg.dtype if kernel == "prefill" and entry.partials == "out" else torch.float32
        if splits > 1 and static is not None:
            n = shape[0] * shape[1] * shape[2]
            if n > static.partial_lse.numel():
                raise ValueError(
                    f"attnplug: {splits} splits of {plan.num_tokens} tokens exceed the static split "
                    f"workspace ({static.partial_lse.numel() // cfg.num_qo_heads} token-splits)"
                )
            partial = static.partial.view(pdt)[: n * shape[3]].view(shape)
            partial_lse = static.partial_lse[:n].view(shape[:3])
        elif splits > 1:
            partial = torch.empty(shape, dtype=pdt, device=self.device)
            partial_lse = torch.empty(shape[:3], dtype=torch.float32, device=self.device)
        counters = None
        if fused:  # zeroed once here (static: at allocation); every launch leaves them zero
            n_cnt = num_tiles * cfg.num_kv_heads
            if static is not None and static.counters is not None and static.counters.numel() >= n_cnt:
                counters = static.counters[:n_cnt]
            elif static is not None:
                raise ValueError(f"attnplug: {num_tiles} tiles exceed the static merge counters")
            else:
                counters = torch.zeros(n_cnt, dtype=torch.int32, device=self.device)
        plan.state = TritonState(
            tile_req=tile_req,
            tile_qstart=tile_q,
            num_tiles=num_tiles,
            num_splits=splits,
            block_q=block_q,
            block_m=block_m,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            partial=partial,
            partial_lse=partial_lse,
            kv_start=o.kv_start,
            kernel=kernel,
            diag_n=diag_n,
            tma=tma,
            counters=counters,
            fp8_f16=cfg.kv_quantized and entry.fp8_f16,
            qk_ahead=kernel == "gluon" and gluon[4],
            loaders=gluon[5] if kernel == "gluon" else 0,
            pingpong=kernel == "gluon" and gluon[6],
            pairs=(
                cfg.kv_quantized
                and kernel == "decode"
                and entry.pairs
                and cfg.head_dim == _next_pow2(cfg.head_dim)
                and cfg.head_dim >= 32
            ),
        )

    # -- run --------------------------------------------------------------------------------------
    def run(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale=None,
        host_scales=None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self._run(plan, q, k_cache, v_cache, out, lse, k_scale, v_scale, sinks=sinks)

    def run_merge(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor,
        scratch_out: torch.Tensor,
        scratch_lse: torch.Tensor,
        **scales,
    ) -> None:
        """A prefill-kernel plan (unsplit, or split with merge counters: a cascade graph's prefix part) merges
        into ``(out, lse)`` inside its one launch, which returns at once when the plan has no keys; a split
        plan of the paged kernel merges its splits straight into ``(out, lse)`` (one merge launch, no
        scratch); other plans take the default (run into scratch, then merge)."""
        a: TritonState = plan.state
        in_kernel = _merges_in_kernel(a)
        if a.kernel == "decode" or (a.num_splits == 1 and not in_kernel) or "sinks" in scales:
            return super().run_merge(plan, q, k_cache, v_cache, out, lse, scratch_out, scratch_lse, **scales)
        # not inside a CUDA IF node: the body's first launch has no kernel before it in its own graph
        self._run(
            plan,
            q,
            k_cache,
            v_cache,
            out,
            lse,
            scales.get("k_scale"),
            scales.get("v_scale"),
            merge_base=True,
            pdl=self._pdl() and not graph_if.requested(),
        )

    def _pdl(self) -> bool:
        """Whether launches may use programmatic dependent launch (:mod:`attnplug.core.kernels.pdl`): the
        paged kernel then lets the next kernel start at once, and :meth:`run_merge`'s prefill-kernel plans
        launch as dependents of the kernel before them (the cascade's suffix part)."""
        if self._pdl_ok is None:
            from ..kernels import pdl

            self._pdl_ok = pdl.available(self.device)
        return self._pdl_ok

    def _run(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        merge_base: bool = False,
        pdl: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """:meth:`run`; ``merge_base`` (split plans): the splits merge into ``(out, lse)``; ``pdl`` (prefill-kernel
        plans): the kernel and the merge after it launch as programmatic dependents (:meth:`_pdl`); ``sinks``:
        ``[Hq]`` sink logits (kernel arguments only when given: launches without sinks are unchanged)."""
        from ..kernels.attention import paged_attention_kernel
        from ..kernels.merge import merge_splits

        a: TritonState = plan.state
        if a.num_tiles == 0:
            return
        cfg = self.config
        if cfg.kv_layout == "NHD":
            ks, vs = (
                (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
                (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
            )
        else:
            ks, vs = (
                (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1)),
                (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1)),
            )
        if a.kernel == "gluon":
            if (
                _aligned16(q, q.stride()[:2])
                and _aligned16(out, out.stride()[:2])
                and _aligned16(k_cache, ks)
                and _aligned16(v_cache, vs)
            ):
                return self._run_gluon(plan, a, q, k_cache, v_cache, ks, vs, out, lse)
            # caches or views the 16-byte copies cannot read: the Triton prefill kernel on the same tile list
            bn = 64 if cfg.head_dim <= 128 else 32
            a = dataclasses.replace(a, kernel="prefill", block_n=bn, num_stages=3, num_warps=8, diag_n=bn)
        if a.kernel == "prefill":
            return self._run_prefill(
                plan, a, q, k_cache, v_cache, ks, vs, out, lse, k_scale, v_scale, merge_base, pdl, sinks
            )
        if a.kernel == "decode":
            return self._run_decode(plan, a, q, k_cache, v_cache, ks, vs, out, lse, k_scale, v_scale, sinks)
        split = a.num_splits > 1
        if split:
            o, o_strides = a.partial, (a.partial.stride(0), a.partial.stride(1), a.partial.stride(2))
            l, l_strides = a.partial_lse, (a.partial_lse.stride(0), a.partial_lse.stride(1))
        else:
            o, o_strides = out, (out.stride(0), out.stride(1), 0)
            l = lse if lse is not None else out
            l_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        mask = plan.mask if plan.mask is not None else plan.kv_lens
        mask_indptr = plan.mask_indptr if plan.mask_indptr is not None else plan.kv_lens
        mask_free = plan.mask_free if plan.mask_free is not None else plan.kv_lens
        fp8 = cfg.kv_quantized  # scales: one-element float32 device tensors (PagedAttention.run's defaults)
        paged_attention_kernel[(a.num_tiles, cfg.num_kv_heads, a.num_splits)](
            q,
            k_cache,
            v_cache,
            o,
            l,
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_lens,
            a.tile_req,
            a.tile_qstart,
            mask,
            mask_indptr,
            mask_free,
            a.kv_start if a.kv_start is not None else plan.kv_lens,
            k_scale if fp8 else plan.kv_lens,
            v_scale if fp8 else plan.kv_lens,
            cfg.scale,
            cfg.logits_soft_cap,
            cfg.window_left,
            a.num_splits,
            q.stride(0),
            q.stride(1),
            *ks,
            *vs,
            *o_strides,
            *l_strides,
            GROUP=cfg.group_size,
            BLOCK_Q=a.block_q,
            BLOCK_M=a.block_m,
            BLOCK_N=a.block_n,
            HEAD_DIM=cfg.head_dim,
            BLOCK_D=_next_pow2(cfg.head_dim),
            PAGE_SIZE=cfg.page_size,
            CAUSAL=plan.causal and plan.mask is None,
            HAS_MASK=plan.mask is not None,
            SOFT_CAP=cfg.logits_soft_cap > 0,
            WINDOW=cfg.window_left >= 0,
            SPLIT=split,
            STORE_LSE=lse is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu",
            HAS_KV_START=a.kv_start is not None,
            KV_FP8=fp8,
            FP8_F16=a.fp8_f16,
            num_warps=a.num_warps,
            num_stages=a.num_stages,
            **({"PDL": True} if self._pdl() else {}),
            **_sink_args(sinks),  # the kernel joins them where unsplit
        )
        if split:
            merge_splits(a.partial, a.partial_lse, out, lse, base=merge_base, sinks=sinks)

    def _run_prefill(
        self,
        plan: Plan,
        a: TritonState,
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        out,
        lse,
        k_scale,
        v_scale,
        merge_base: bool = False,
        pdl: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The prefill kernel (:mod:`attnplug.core.kernels.prefill`), grid ``(tiles, Hkv)``: causal; or
        non-causal (a cascade prefix part), grid ``(tiles, Hkv, splits)``, the splits' partials then
        merged into ``(out, lse)`` (``merge_base``: into the state they hold). ``pdl``: both launches are
        programmatic dependents of the kernel before them (:mod:`attnplug.core.kernels.pdl`)."""
        from ..kernels.merge import merge_splits
        from ..kernels.prefill import prefill_kernel

        cfg = self.config
        fp8 = cfg.kv_quantized
        k_desc, v_desc = (
            (_kv_descriptor(k_cache, ks, cfg, a.block_n), _kv_descriptor(v_cache, vs, cfg, a.block_n))
            if a.tma
            else (k_cache, v_cache)
        )
        split = a.num_splits > 1
        if split:
            o, l = a.partial, a.partial_lse
            o_strides, l_strides = (o.stride(0), o.stride(1)), (l.stride(0), l.stride(1))
        else:
            o, l, o_strides = out, (lse if lse is not None else out), (out.stride(0), out.stride(1))
            l_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        noncausal = not plan.causal and plan.mask is None
        fused = merge_base and noncausal and sinks is None and (not split or a.counters is not None)
        base = {}
        if fused:  # the merge into the suffix state (out, lse) happens in the kernel
            base = dict(
                MERGE_BASE=True,
                COUNTERS=a.counters if split else plan.kv_lens,
                BASE_O=out,
                BASE_L=lse,
                stride_bot=out.stride(0),
                stride_boh=out.stride(1),
                stride_blt=lse.stride(0),
                stride_blh=lse.stride(1),
            )
        strided = a.tile_count is not None
        if strided and not fused:
            raise ValueError(
                "attnplug: a cascade graph's prefix plan runs only through run_merge (its tiles: the cut groups)"
            )
        if strided:
            base.update(TILE_COUNT=a.tile_count, STRIDED=True)
        prefill_kernel[(a.grid_tiles if strided else a.num_tiles, cfg.num_kv_heads, a.num_splits)](
            q,
            k_cache,
            v_cache,
            o,
            l,
            k_desc,
            v_desc,
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_lens,
            a.tile_req,
            a.tile_qstart,
            k_scale if fp8 else plan.kv_lens,
            v_scale if fp8 else plan.kv_lens,
            a.num_tiles,
            cfg.scale,
            q.stride(0),
            q.stride(1),
            *ks,
            *vs,
            *o_strides,
            *l_strides,
            GROUP=cfg.group_size,
            BLOCK_Q=a.block_q,
            BLOCK_M=a.block_m,
            BLOCK_N=a.block_n,
            DIAG_N=a.diag_n,
            HEAD_DIM=cfg.head_dim,
            BLOCK_D=_next_pow2(cfg.head_dim),
            PAGE_SIZE=cfg.page_size,
            PAGE_TMA=a.tma,
            NUM_STAGES=a.num_stages,
            STORE_LSE=lse is not None or split,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu",
            KV_FP8=fp8,
            FP8_F16=a.fp8_f16,
            NONCAUSAL=noncausal,
            num_splits=a.num_splits,
            stride_os=o.stride(2) if split else 0,
            num_warps=a.num_warps,
            num_stages=a.num_stages,
            **({"PDL": True, "launch_pdl": True} if pdl else {}),
            **_sink_args(None if split else sinks),  # split: the merge adds them
            **base,
        )
        if split and not fused:
            merge_splits(a.partial, a.partial_lse, out, lse, base=merge_base, pdl=pdl, sinks=sinks)

    def _run_gluon(self, plan: Plan, a: TritonState, q, k_cache, v_cache, ks, vs, out, lse) -> None:
        """The Gluon prefill kernel (:mod:`attnplug.core.kernels.gluon_prefill`): grid ``(tiles, Hkv)``; the
        warp-specialized one where the plan has gather warps (``a.loaders``)."""
        from ..kernels import gluon_prefill as gp

        cfg = self.config
        if a.loaders:
            cap, compute, loader = gp.ws_registers(a.num_warps, a.loaders)
            kernel, warps = gp.gluon_prefill_ws_kernel, a.num_warps // 2  # the default partition: one warpgroup
            extra = dict(LOADERS=a.loaders, COMPUTE_REGS=compute, LOADER_REGS=loader, PINGPONG=a.pingpong, maxnreg=cap)
        else:
            kernel, warps, extra = gp.gluon_prefill_kernel, a.num_warps, dict(QK_AHEAD=a.qk_ahead)
        kernel[(a.num_tiles, cfg.num_kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            lse if lse is not None else out,
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_lens,
            a.tile_req,
            a.tile_qstart,
            a.num_tiles,
            cfg.scale,
            q.stride(0),
            q.stride(1),
            *ks,
            *vs,
            out.stride(0),
            out.stride(1),
            *((lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)),
            GROUP=cfg.group_size,
            BLOCK_Q=a.block_q,
            BLOCK_M=a.block_m,
            BLOCK_N=a.block_n,
            HEAD_DIM=cfg.head_dim,
            PAGE_SIZE=cfg.page_size,
            NUM_STAGES=a.num_stages,
            STORE_LSE=lse is not None,
            num_warps=warps,
            **extra,
        )

    def _run_decode(
        self,
        plan: Plan,
        a: TritonState,
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        out,
        lse,
        k_scale,
        v_scale,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The split-KV decode kernel (:mod:`attnplug.core.kernels.decode`), grid ``(B, Hkv, splits)``;
        the merge is fused (``a.counters``) or :func:`~attnplug.core.kernels.merge.merge_splits` after."""
        from ..kernels.decode import decode_kernel
        from ..kernels.merge import merge_splits

        cfg = self.config
        fp8 = cfg.kv_quantized
        split, fused = a.num_splits > 1, a.counters is not None
        p, pl = (a.partial, a.partial_lse) if split else (out, out)
        l = lse if lse is not None else out
        bd, gp = _next_pow2(cfg.head_dim), _next_pow2(cfg.group_size)
        merge_s = max(2, _next_pow2(a.num_splits))
        decode_kernel[(a.num_tiles, cfg.num_kv_heads, a.num_splits)](
            q,
            k_cache,
            v_cache,
            out,
            l,
            p,
            pl,
            a.counters if fused else plan.kv_lens,
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_lens,
            k_scale if fp8 else plan.kv_lens,
            v_scale if fp8 else plan.kv_lens,
            cfg.scale,
            cfg.logits_soft_cap,
            cfg.window_left,
            a.num_splits,
            q.stride(0),
            q.stride(1),
            *ks,
            *vs,
            out.stride(0),
            out.stride(1),
            *((lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)),
            *((p.stride(0), p.stride(1), p.stride(2), pl.stride(0), pl.stride(1)) if split else (0, 0, 0, 0, 0)),
            GROUP=cfg.group_size,
            BLOCK_M=max(16, gp),
            BLOCK_N=a.block_n,
            HEAD_DIM=cfg.head_dim,
            BLOCK_D=bd,
            PAGE_SIZE=cfg.page_size,
            SOFT_CAP=cfg.logits_soft_cap > 0,
            WINDOW=cfg.window_left >= 0,
            SPLIT=split,
            FUSED_MERGE=fused,
            MERGE_S=merge_s,
            MERGE_CHUNK=max(1, min(merge_s, 4096 // (gp * bd))),
            NUM_STAGES=a.num_stages,
            STORE_LSE=lse is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu",
            KV_FP8=fp8,
            FP8_F16=a.fp8_f16,
            PAIRS=a.pairs and _even(k_cache, ks) and _even(v_cache, vs),
            num_warps=a.num_warps,
            num_stages=a.num_stages,
            **_sink_args(sinks),  # unsplit or the fused merge
        )
        if split and not fused:
            merge_splits(a.partial, a.partial_lse, out, lse, sinks=sinks)


def _merges_in_kernel(a) -> bool:
    """A plan state (``TritonState``; an MLA state has no ``kernel``) whose prefill-kernel launch merges into a base
    state itself: unsplit, or split with merge counters (:meth:`TritonProvider.run_merge`)."""
    return getattr(a, "kernel", None) == "prefill" and (a.num_splits == 1 or a.counters is not None)


def _sink_args(sinks: torch.Tensor | None) -> dict:
    """The kernels' sink arguments: none without sinks (their ``HAS_SINKS`` default compiles them out)."""
    return {} if sinks is None else {"SINKS": sinks, "HAS_SINKS": True}


def _kv_descriptor(cache: torch.Tensor, strides: tuple[int, int, int], cfg: AttentionConfig, block_n: int):
    """A 4-D tensor descriptor over a K or V cache, dims ``(page, token, head, d)`` whatever the
    layout (the strides say where each lives), block ``[1, block_n, 1, D]``: one page's rows of one
    KV head (the prefill kernel's ``PAGE_TMA`` loads)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    sp, st, sh = strides
    return TensorDescriptor(
        cache,
        [cache.shape[0], cfg.page_size, cfg.num_kv_heads, cfg.head_dim],
        [sp, st, sh, 1],
        [1, block_n, 1, cfg.head_dim],
    )


class TritonRagged(RaggedKernel):
    """attnplug's cache-free prefill kernel (:mod:`attnplug.core.kernels.ragged`): 128-query tiles, 64-key
    blocks; the qk head dim as two dots (192 = 128 + 64)."""

    BLOCK_M, BLOCK_N, WARPS, STAGES = 128, 64, 8, 2

    @classmethod
    def refusal(cls, config) -> str | None:
        if not (16 <= config.head_dim <= 512 and 16 <= config.head_dim_v <= 256):
            return (
                f"ragged prefill with head dims {config.head_dim}/{config.head_dim_v} (its kernel: qk 16..512, "
                "v 16..256)"
            )
        return None

    def run(self, plan, q, k, v, out) -> None:
        from ..kernels.ragged import ragged_prefill  # noqa: PLC0415

        ragged_prefill(
            q,
            k,
            v,
            out,
            plan.cu_q,
            plan.cu_k,
            plan.max_q,
            self.config.scale,
            plan.causal,
            self.BLOCK_M,
            self.BLOCK_N,
            self.WARPS,
            self.STAGES,
        )
