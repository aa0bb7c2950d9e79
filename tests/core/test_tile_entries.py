"""The tile table read through typed entries: every entry converts, unknown fields are refused, lookups fall back."""

from __future__ import annotations

import pytest

from attnplug.core.kernels import tiles


def test_every_entry_is_a_tile_entry():
    for k, e in tiles.TILES.items():
        t = tiles.TileEntry.of(e)
        assert t and all(getattr(t, f) == v for f, v in e.items()), k


def test_unknown_field_refused_and_missing_entry_is_falsy():
    with pytest.raises(ValueError, match="unknown field.*block_z"):
        tiles.TileEntry.of({"block_z": 3})
    assert not tiles.first_entry({}, ("d64/g1/decode",)) and tiles.first_entry({}, ()) is tiles.NO_ENTRY


def test_lookup_order_and_conversion_once():
    table = {"d128/g*/decode": {"block_n": 64}, "d128/g4/decode": {"block_n": 32, "num_warps": 2}}
    e = tiles.lookup(128, 4, "decode_wide", table)  # decode_wide falls back to decode; the exact group wins
    assert (e.block_n, e.num_warps, e.kernel) == (32, 2, None)
    assert tiles.lookup(128, 2, "decode", table).block_n == 64
    assert tiles.lookup(128, 4, "decode", table) is e  # converted once per entry
