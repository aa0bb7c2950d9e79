"""Tile configurations of the triton provider, per (head_dim bucket, GQA group, query bucket).

Read by :meth:`attnplug.core.providers.triton.TritonProvider.plan` (no autotuning in the serving
path). ``benchmarks/sweep_triton.py`` measures candidates on the GPU and rewrites :data:`TILES`
(the block between the markers below, with a line naming the sweeps that chose its entries); the
seeds are the provider's first measured choices (``docs/measured-choices.md``), so a table that
nothing re-measured behaves as the provider did before the table existed.

Keys are ``"d{D}/g{G}/{bucket}"``: ``D`` = the head dim rounded up to 64 / 128 / 256, ``G`` = the
GQA group rounded up to a power of two, or ``*`` for any group (an exact group wins); a ``/fp8``
suffix: the entry for fp8 KV caches (they fall back to the 16-bit entries). Buckets:

* ``prefill``: queries fill a ``block_m`` tile (``max_q_len * G >= block_m``), no custom mask;
* ``noncausal``: like ``prefill`` without the causal mask (the cascade's shared-prefix parts: every
  query row sees every key), split-KV: the paged kernel, or ``kernel: "prefill"`` (:mod:`.prefill` run
  non-causal; 16-bit KV caches) with ``ctas_per_sm`` (programs an SM, rounded down:
  ``benchmarks/sweep_cascade_prefix.py``); falls back to the ``prefill`` entry;
* ``short``: shorter queries (the tile shrinks to ``next_pow2(max_q_len * G)`` rows);
* ``verify``: a custom mask (tree verify);
* ``decode``: one query token per request and ``SMs <= B * Hkv <= 4 * SMs`` (no split);
* ``decode_wide``: one token, ``B * Hkv > 4 * SMs`` (more programs than one wave of four an SM);
  falls back to the ``decode`` entry;
* ``decode_split``: one token, ``16 <= B * Hkv < SMs`` (split-KV); ``decode_tiny``: ``B * Hkv < 16``.

Entry fields (all optional): ``kernel`` (``"paged"``: :mod:`.attention`; ``"prefill"``:
:mod:`.prefill`, causal without mask / window / soft cap; ``"decode"``: :mod:`.decode`),
``block_m``, ``block_n``, ``num_warps``, ``num_stages``; ``prefill``: ``diag_n`` (diagonal block),
``tma`` (tensor-descriptor K/V loads when the page size is a multiple of ``block_n``); split buckets
(and ``decode`` entries that name it: full batches split too): ``ctas_per_sm`` (split so that
``B * Hkv * splits`` reaches this many programs per SM),
``whole_waves`` (at most ``ctas_per_sm`` programs an SM, or one more where that leaves a fifth of
the slots idle: the split count rounds down, not up),
``max_splits``, ``min_split_keys`` (default: 128, 512 for fp8 ``decode_split``), ``fused_merge``
(``decode`` kernel: the last split merges); ``partials: "out"`` (``noncausal`` prefill-kernel entries: split
partials stored in the output dtype instead of float32);
``fp8_f16`` (fp8 entries: fp16 dots, :mod:`.attention`); ``pairs`` (fp8 entries, ``decode`` kernel: K/V read
as 16-bit byte pairs, :mod:`.decode`);
``small_tiles_from_splits`` (seed only: the tile fields apply from this many splits on, below it
the ``decode_split`` tiles do: the seed's rule).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# ---- BEGIN TILES (rewritten by benchmarks/sweep_triton.py) ----
# d128/g4/noncausal from benchmarks/sweep_cascade_prefix.py (cascade decode 64x(8192+256), the prefix part as graph replays); sweeps of 2026-12-03 on NVIDIA H200, triton 3.6.0: sweep-fp8 --pairs-only (decode 64x4096 fp8, 1x32768 fp8, 4x32768 fp8): 3 entries chosen (byte pairs), d128/g4/decode/fp8 again by a second one (64x4096 fp8: 7 stages); d128/g4/decode from sweep-shared (64x4096, 128x2048, 64x(8192 shared+256), 64x(8192+256)); the rest from the sweeps of 2026-12-02 and before; d128/g4/decode_wide/fp8 from sweep-fp8 --pairs-only of 2026-12-04 (decode 64x4096 fp8, 128x2048 fp8: 6 stages, 128x2048 0.1996 -> 0.1421 ms) and benchmarks/probes/split_probe.py --knob num_stages (6 stages win from 768 programs on, 7 up to 512)
# fmt: off
TILES: dict[str, dict] = {
    'd128/g*/decode': {'kernel': 'paged', 'block_n': 128, 'num_warps': 4, 'num_stages': 3},
    'd128/g*/decode_split': {'kernel': 'paged', 'block_n': 128, 'num_warps': 4, 'num_stages': 3, 'ctas_per_sm': 2},
    'd128/g*/decode_tiny': {'kernel': 'paged', 'block_n': 64, 'num_warps': 2, 'num_stages': 2, 'ctas_per_sm': 4, 'small_tiles_from_splits': 32},
    'd128/g*/prefill': {'kernel': 'paged', 'block_m': 128, 'block_n': 32, 'num_warps': 4, 'num_stages': 3},
    'd128/g*/short': {'kernel': 'paged', 'block_n': 32, 'num_warps': 4, 'num_stages': 3},
    'd128/g*/verify': {'kernel': 'paged', 'block_m': 128, 'block_n': 128, 'num_warps': 8, 'num_stages': 3},
    'd128/g4/decode': {'block_n': 64, 'kernel': 'paged', 'num_stages': 3, 'num_warps': 2},
    'd128/g4/decode/fp8': {'block_n': 32, 'fp8_f16': True, 'kernel': 'decode', 'num_stages': 7, 'num_warps': 1, 'pairs': True},
    'd128/g4/decode_wide/fp8': {'block_n': 32, 'fp8_f16': True, 'kernel': 'decode', 'num_stages': 6, 'num_warps': 1, 'pairs': True},
    'd128/g4/decode_split': {'block_n': 128, 'ctas_per_sm': 2, 'fused_merge': True, 'kernel': 'decode', 'min_split_keys': 512, 'num_stages': 5, 'num_warps': 4, 'whole_waves': True},
    'd128/g4/decode_split/fp8': {'block_n': 256, 'ctas_per_sm': 4, 'fp8_f16': True, 'fused_merge': True, 'kernel': 'decode', 'num_stages': 3, 'num_warps': 4, 'pairs': True},
    'd128/g4/decode_tiny': {'block_n': 128, 'ctas_per_sm': 1, 'fused_merge': True, 'kernel': 'decode', 'num_stages': 5, 'num_warps': 4},
    'd128/g4/decode_tiny/fp8': {'block_n': 128, 'ctas_per_sm': 2, 'fp8_f16': True, 'fused_merge': True, 'kernel': 'decode', 'num_stages': 5, 'num_warps': 4, 'pairs': True},
    'd128/g4/noncausal': {'kernel': 'prefill', 'block_m': 256, 'block_n': 64, 'num_warps': 16, 'num_stages': 2, 'ctas_per_sm': 1, 'partials': 'out'},
    'd128/g4/prefill': {'block_m': 128, 'block_n': 128, 'kernel': 'prefill', 'num_stages': 3, 'num_warps': 8, 'tma': True},
    'd128/g4/prefill/fp8': {'block_m': 128, 'block_n': 128, 'diag_n': 64, 'fp8_f16': True, 'kernel': 'prefill', 'num_stages': 5, 'num_warps': 8},
    'd256/g*/decode': {'kernel': 'paged', 'block_n': 64, 'num_warps': 4, 'num_stages': 2},
    'd256/g*/decode_split': {'kernel': 'paged', 'block_n': 64, 'num_warps': 4, 'num_stages': 2, 'ctas_per_sm': 2},
    'd256/g*/decode_tiny': {'kernel': 'paged', 'block_n': 64, 'num_warps': 4, 'num_stages': 2, 'ctas_per_sm': 4},
    'd256/g*/prefill': {'kernel': 'paged', 'block_m': 64, 'block_n': 32, 'num_warps': 4, 'num_stages': 2},
    'd256/g*/short': {'kernel': 'paged', 'block_n': 32, 'num_warps': 4, 'num_stages': 2},
    'd256/g*/verify': {'kernel': 'paged', 'block_m': 64, 'block_n': 32, 'num_warps': 4, 'num_stages': 2},
    'd256/g2/decode_split': {'block_n': 64, 'ctas_per_sm': 4, 'fused_merge': False, 'kernel': 'decode', 'num_stages': 5, 'num_warps': 4},
    'd256/g2/decode_tiny': {'block_n': 32, 'ctas_per_sm': 2, 'fused_merge': True, 'kernel': 'decode', 'num_stages': 7, 'num_warps': 4},
    'd256/g2/prefill': {'block_m': 128, 'block_n': 64, 'kernel': 'prefill', 'num_stages': 3, 'num_warps': 8},
    'd64/g*/decode': {'kernel': 'paged', 'block_n': 128, 'num_warps': 4, 'num_stages': 3},
    'd64/g*/decode_split': {'kernel': 'paged', 'block_n': 128, 'num_warps': 4, 'num_stages': 3, 'ctas_per_sm': 2},
    'd64/g*/decode_tiny': {'kernel': 'paged', 'block_n': 64, 'num_warps': 2, 'num_stages': 2, 'ctas_per_sm': 4, 'small_tiles_from_splits': 32},
    'd64/g*/prefill': {'kernel': 'paged', 'block_m': 128, 'block_n': 32, 'num_warps': 4, 'num_stages': 3},
    'd64/g*/short': {'kernel': 'paged', 'block_n': 32, 'num_warps': 4, 'num_stages': 3},
    'd64/g*/verify': {'kernel': 'paged', 'block_m': 128, 'block_n': 128, 'num_warps': 8, 'num_stages': 3},
    'd64/g4/decode_split': {'block_n': 128, 'ctas_per_sm': 2, 'fused_merge': True, 'kernel': 'decode', 'num_stages': 5, 'num_warps': 4},
    'd64/g4/decode_tiny': {'block_n': 256, 'ctas_per_sm': 2, 'fused_merge': True, 'kernel': 'decode', 'num_stages': 2, 'num_warps': 8},
    'd64/g4/prefill': {'block_m': 128, 'block_n': 128, 'kernel': 'prefill', 'num_stages': 3, 'num_warps': 4},
}
# fmt: on
# ---- END TILES ----

BUCKETS = ("prefill", "noncausal", "short", "verify", "decode", "decode_wide", "decode_split", "decode_tiny")
FALLBACK = {"decode_wide": "decode"}  # a bucket without an entry of its own reads this one's


def head_dim_bucket(head_dim: int) -> int:
    """64, 128 or 256: the power of two the head dim is padded to (at least 64)."""
    return 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)


def group_bucket(group: int) -> int:
    """The GQA group rounded up to a power of two."""
    return 1 << max(0, group - 1).bit_length()


def key(head_dim: int, group: int | str, bucket: str, fp8: bool = False) -> str:
    g = group if group == "*" else group_bucket(int(group))
    return f"d{head_dim_bucket(head_dim)}/g{g}/{bucket}" + ("/fp8" if fp8 else "")


def lookup_keys(head_dim: int, group: int, bucket: str, fp8: bool = False) -> tuple[str, ...]:
    """The keys :func:`lookup` tries, in its order: an fp8 KV cache (``fp8``) its own entries
    (``.../fp8``) first, then the 16-bit ones; within each, the bucket's, then its :data:`FALLBACK`'s;
    within each, the exact group's, then the any-group one."""
    buckets = (bucket, FALLBACK[bucket]) if bucket in FALLBACK else (bucket,)
    return tuple(
        key(head_dim, g, b, f) for f in ((True, False) if fp8 else (False,)) for b in buckets for g in (group, "*")
    )


def lookup(head_dim: int, group: int, bucket: str, table: dict | None = None, fp8: bool = False) -> TileEntry:
    """The entry for this shape: the first of :func:`lookup_keys` in ``table`` (default
    :data:`TILES`), typed, else :data:`NO_ENTRY`."""
    return first_entry(TILES if table is None else table, lookup_keys(head_dim, group, bucket, fp8))


@dataclass(frozen=True)
class TileEntry:
    """One table entry, typed (the fields of the module docstring; ``None`` / ``False``: not set, the
    reader's default applies). Falsy when the table held no entry for the shape."""

    kernel: str | None = None
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    diag_n: int | None = None
    tma: bool = False
    ctas_per_sm: int | None = None
    whole_waves: bool = False
    max_splits: int | None = None
    min_split_keys: int | None = None
    fused_merge: bool = False
    partials: str | None = None
    fp8_f16: bool = False
    pairs: bool = False
    small_tiles_from_splits: int = 0

    def __bool__(self) -> bool:
        return self != NO_ENTRY

    @classmethod
    def of(cls, entry: dict) -> TileEntry:
        """The typed form of a table entry (``ValueError`` naming an unknown field)."""
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise ValueError(f"attnplug: tile-table entry {entry} has unknown field(s) {unknown}")
        return cls(**entry)


NO_ENTRY = TileEntry()
_FIELDS = {f.name for f in fields(TileEntry)}
_TYPED: dict[int, tuple[dict, TileEntry]] = {}  # id(entry dict) -> (the dict, kept so its id stays its own; typed)


def typed(entry: dict) -> TileEntry:
    """:meth:`TileEntry.of`, converted once per entry dict (the table is read at every plan)."""
    hit = _TYPED.get(id(entry))
    if hit is None or hit[0] is not entry:
        hit = _TYPED[id(entry)] = (entry, TileEntry.of(entry))
    return hit[1]


def first_entry(table: dict, keys: tuple[str, ...]) -> TileEntry:
    """The entry of the first of ``keys`` that ``table`` holds (typed), else :data:`NO_ENTRY`."""
    for k in keys:
        e = table.get(k)
        if e is not None:
            return typed(e)
    return NO_ENTRY
