"""What a cascade decode graph replays when its batch shares nothing: the launches of one replay
(``GraphState.run``, what a capture records) counted with cascade on and off, per provider. The
prefix part is one prefill-kernel launch that merges into the suffix state in the kernel and returns
at once without keys (``docs/cascade.md``); the outputs still equal the float32 reference."""

from __future__ import annotations

import collections

import fa3_standin
import pytest
from test_cascade_graph import DEV, check_out, make_case, state

from attnplug.core.kernels import tiles

KERNELS = (
    ("attnplug.core.kernels.attention", "paged_attention_kernel"),
    ("attnplug.core.kernels.decode", "decode_kernel"),
    ("attnplug.core.kernels.prefill", "prefill_kernel"),
    ("attnplug.core.kernels.merge", "merge_splits_kernel"),
    ("attnplug.core.kernels.merge", "merge_state_kernel"),
    ("attnplug.core.kernels.merge", "apply_sinks_kernel"),
)


def count_launches(monkeypatch, provider: str) -> list[str]:
    """Every triton kernel launch (and FA3 library call) from here on is appended to the returned
    list, then run as it is."""
    import importlib

    launches: list[str] = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(self.name)
                return self.kernel[grid](*args, **kw)

            return launch

    for mod_name, name in KERNELS:
        mod = importlib.import_module(mod_name)
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, Counted(name, getattr(mod, name)))
    if provider == "fa3":
        from attnplug.core.providers import fa3

        paged = fa3.FA3Lib.paged

        def counted_paged(self, *a, **kw):
            launches.append("fa3")
            return paged(self, *a, **kw)

        monkeypatch.setattr(fa3.FA3Lib, "paged", counted_paged)
    return launches


@pytest.fixture(params=["triton", "fa3"])
def provider(request, monkeypatch):
    if request.param == "fa3":
        fa3_standin.use_fa3(monkeypatch, DEV)
    return request.param


@pytest.mark.parametrize("splits", [3, 1])
def test_an_unshared_replay_pays_one_launch_for_the_prefix_part(provider, splits, monkeypatch):
    """The noncausal tile entry names the prefill kernel (as the H200's d128/g4 entry does): with
    cascade on, a replay of a batch that shares nothing launches exactly one kernel more than with
    cascade off, the prefix part's prefill kernel (split or not; no merge launch, no FA3 call), and
    the outputs equal the reference; a batch that shares a prefix replays the very same launches."""
    c, batch, q, k, v, n = make_case("nothing shared", seed=5, provider=provider)
    entry = {"kernel": "prefill", "block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}
    monkeypatch.setitem(tiles.TILES, tiles.key(c.head_dim, c.group_size, "noncausal"), entry)
    bs = batch.batch_size + 1
    per_mode = {}
    for mode in ("off", "always"):
        gs = state(c, mode, provider=provider, num_kv_splits=splits)
        gs.prepare_capture(bs)
        gs.update(batch, bs)
        launches = count_launches(monkeypatch, provider)
        check_out(c, batch, q, k, v, n, gs, bs)
        per_mode[mode] = collections.Counter(launches)
        monkeypatch.undo()  # the counting wrappers off again (and the tile entry: set it back)
        if provider == "fa3":
            fa3_standin.use_fa3(monkeypatch, DEV)
        monkeypatch.setitem(tiles.TILES, tiles.key(c.head_dim, c.group_size, "noncausal"), entry)
        if mode == "always":
            assert int(gs.cascade.kv_lens.sum()) == 0 and not bool(gs.cascade.active)
            assert gs.cascade.plans[bs].state.kernel == "prefill"
            shared_case = make_case("one group", seed=6, provider=provider)
            sc, sb, sq, sk, sv, sn = shared_case
            gs.update(sb, sb.batch_size + 1)
            launches = count_launches(monkeypatch, provider)
            check_out(sc, sb, sq, sk, sv, sn, gs, sb.batch_size + 1)
            assert int(gs.cascade.kv_lens.sum()) > 0
            launches.clear()
            check_out(sc, sb, sq, sk, sv, sn, gs, sb.batch_size + 1)  # again: the merge counters re-armed
            assert collections.Counter(launches) == per_mode["always"], "a captured graph replays one launch list"
    extra = per_mode["always"] - per_mode["off"]
    assert extra == collections.Counter({"prefill_kernel": 1}), per_mode
    assert not (per_mode["off"] - per_mode["always"]), per_mode


def test_cascade_graphs_are_opt_in_under_the_cascade_mode(monkeypatch):
    """Unset (or ``0``), ``ATTNPLUG_CASCADE_GRAPHS`` leaves cascade out of the decode / verify graphs;
    ``1`` puts it in the graphs of providers whose graphs run it, under ``ATTNPLUG_CASCADE``'s mode
    (``0`` turns it off again); a provider whose graphs cannot run it stays off; a malformed value is
    refused."""
    from attnplug.core.cascade import graph_cascade_mode
    from attnplug.core.providers import get_provider_cls

    for var in ("ATTNPLUG_CASCADE_GRAPHS", "ATTNPLUG_CASCADE", "ATTNPLUG_GRAPH_IF"):
        monkeypatch.delenv(var, raising=False)
    support = {p: get_provider_cls(p).graph_support for p in ("triton", "fa3", "flashinfer")}
    assert {p: graph_cascade_mode(s) for p, s in support.items()} == dict.fromkeys(support, "off")
    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "1")
    assert {p: graph_cascade_mode(s) for p, s in support.items()} == {
        "triton": "auto",
        "fa3": "auto",
        "flashinfer": "off",
    }
    monkeypatch.setenv("ATTNPLUG_CASCADE", "always")
    assert graph_cascade_mode(support["triton"]) == "always"
    monkeypatch.setenv("ATTNPLUG_CASCADE", "0")
    assert graph_cascade_mode(support["triton"]) == "off"
    monkeypatch.delenv("ATTNPLUG_CASCADE")
    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "0")
    assert graph_cascade_mode(support["fa3"]) == "off"
    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "yes please")
    with pytest.raises(ValueError, match="ATTNPLUG_CASCADE_GRAPHS"):
        graph_cascade_mode(support["triton"])
