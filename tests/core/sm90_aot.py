"""Compile every Triton kernel launch attnplug makes, as it makes it, for Hopper (sm90 cubin) on a
machine without a GPU: run by tests/core/test_kernels_compile_sm90.py in a subprocess without the
interpreter.

The core runs its real plan/run code on CPU tensors for a set of representative batches (decode with
and without KV splits, long-context decode, causal prefill, tree verify, soft cap + sliding window,
HND fp16, head_dim 256, LSE output, fa3's tree part (keys from ``kv_start``) and merge, the Hopper
prefill / split-decode kernels at the H200 sweep's candidate tiles (TMA pages, fused merge), fp8 KV caches
(e4m3 / e5m2: attention dequantizing on load, the quantizing KV write, fa3's query quantization),
attention sinks (gpt-oss's 64/8 heads at d64, window 128 and full: each kernel's sink variant, split
merges, the fold kernel), MLA (the absorbed latent kernel in every mode, the latent write), the KV
write and the replay-metadata kernel in its
vLLM / SGLang / FA3 / chain-mask forms, the Gluon prefill kernel at every configuration the provider
launches on sm90 (compiled from its Gluon source); each ``kernel[grid](...)`` is recorded instead of launched,
its arguments specialized as Triton's JIT does on a GPU (pointer / int dtypes, divisibility by 16,
ints equal to 1 as constexprs, tensor descriptors; constexprs by value, ``UPCAST`` False as on a GPU;
``num_warps`` / ``num_stages`` as launched) and compiled through Triton's NVIDIA pipeline to a cubin
(ptxas included). The provider's
SM count is set to the H200's 132 so the split heuristics pick the GPU's configurations.

    python tests/core/sm90_aot.py          # prints "compiled N distinct launches for sm90"
    python tests/core/sm90_aot.py --stats  # and each launch's registers, stack (spills), shared memory
    python tests/core/sm90_aot.py --only gluon_prefill_kernel  # compile one kernel's launches (all recorded)
    python tests/core/sm90_aot.py --shard 0/2  # every second launch (in a stable order), from the first
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import Counter

assert os.environ.get("TRITON_INTERPRET") != "1", "run without the Triton interpreter"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import attnplug.core.kernels.attention as attention_mod  # noqa: E402
import attnplug.core.kernels.decode as decode_mod  # noqa: E402
import attnplug.core.kernels.graph_update as graph_mod  # noqa: E402
import attnplug.core.kernels.kv_write as kv_mod  # noqa: E402
import attnplug.core.kernels.merge as merge_mod  # noqa: E402
import attnplug.core.kernels.mla as mla_mod  # noqa: E402
import attnplug.core.kernels.prefill as prefill_mod  # noqa: E402
import attnplug.core.kernels.ragged as ragged_mod  # noqa: E402
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention  # noqa: E402
from attnplug.core.cuda_graph import GraphState  # noqa: E402
from attnplug.core.kernels import tiles  # noqa: E402
from attnplug.core.providers.triton import GLUON_TRITON  # noqa: E402

GLUON = GLUON_TRITON[0] <= tuple(int(x) for x in triton.__version__.split(".")[:2]) <= GLUON_TRITON[1]
if GLUON:
    from triton.experimental.gluon._runtime import GluonASTSource

    import attnplug.core.kernels.gluon_prefill as gluon_mod
from batches import random_case  # noqa: E402

from attnplug.core.providers.triton import TritonProvider  # noqa: E402

H200_SMS = 132
DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
LAUNCHES: dict[tuple, tuple] = {}


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` records the launch."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kw):
            sig, const, opts, attrs = signature(self.fn, args, kw)
            LAUNCHES.setdefault(
                (
                    self.fn.__name__,
                    tuple(sig.items()),
                    tuple(const.items()),
                    tuple(opts.items()),
                    tuple((k, str(v)) for k, v in attrs.items()),
                ),
                (self.fn, sig, const, opts, attrs),
            )

        return launch


def signature(fn, args, kw):
    """Triton signature, constexprs, options and attributes of one launch, specialized as the JIT
    specializes it on a GPU (``native_specialize_impl``: pointers and ints divisible by 16 get
    ``tt.divisibility``, an int equal to 1 becomes a constexpr, tensor descriptors keep their block
    type), so the cubin is the one the GPU would build (vectorized, pipelined loads)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # an older layout: plain types, no attributes
        native_specialize_impl = None
    names = fn.arg_names
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kw.items() if k in names})
    opts = {k: kw[k] for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg") if k in kw}
    sig, const, attrs = {}, {}, {}
    defaults = {k: q.default for k, q in inspect.signature(fn.fn).parameters.items()}
    for i, (name, p) in enumerate(zip(names, fn.params)):
        v = bound[name] if name in bound else defaults[name]  # an argument left out: its default
        if p.is_constexpr:
            sig[name], const[(i,)] = "constexpr", (False if name == "UPCAST" else v)  # UPCAST: CPU only
        elif native_specialize_impl is not None:
            ty, spec = native_specialize_impl(BaseBackend, v, False, True, True)
            sig[name] = ty
            if ty == "constexpr":
                const[(i,)] = v
            elif spec:
                attrs[(i,)] = BaseBackend.parse_attr(spec)
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + DTYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return sig, const, opts, attrs


def record_all() -> None:
    for mod, names in (
        (attention_mod, ["paged_attention_kernel"]),
        (merge_mod, ["merge_splits_kernel", "merge_state_kernel", "apply_sinks_kernel"]),
        (prefill_mod, ["prefill_kernel"]),
        (decode_mod, ["decode_kernel"]),
        (kv_mod, ["write_kv_kernel", "quantize_rows_kernel"]),
        (graph_mod, ["graph_batch_from_block_table_kernel", "shared_pages_kernel"]),
        (mla_mod, ["mla_attention_kernel", "write_latent_kernel"]),
        (ragged_mod, ["ragged_prefill_kernel"]),
        *([(gluon_mod, ["gluon_prefill_kernel", "gluon_prefill_ws_kernel"])] if GLUON else []),
    ):
        for n in names:
            setattr(mod, n, Recorder(getattr(mod, n)))
    TritonProvider.check_available = classmethod(lambda cls, device: None)  # CPU tensors, compiled triton
    TritonProvider._pdl = lambda self: True  # as on sm90: programmatic dependent launch (kernels/pdl.py)
    llama = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    cases = [  # (config, mode, q lens, prefix lens, with LSE)
        (llama, ForwardMode.DECODE, [1] * 4, [99, 1999, 32, 700], False),  # KV splits + merge
        (llama, ForwardMode.DECODE, [1], [32767], False),  # >= 32 splits: the small-tile decode
        (llama, ForwardMode.DECODE, [1] * 64, [1023] * 64, False),  # no split
        (llama, ForwardMode.EXTEND, [37, 200], [0, 50], False),  # causal prefill
        (llama, ForwardMode.TARGET_VERIFY, [8, 8], [300, 40], False),  # tree mask
        (llama, ForwardMode.EXTEND, [5, 9], [7, 0], True),  # LSE output
        (
            AttentionConfig(8, 8, 64, 1, torch.float16, "HND", None, 30.0, 63),
            ForwardMode.EXTEND,
            [12, 3],
            [100, 2],
            False,
        ),
        (AttentionConfig(8, 2, 256, 16, torch.float16), ForwardMode.EXTEND, [20], [40], False),  # head_dim 256
        (AttentionConfig(8, 2, 256, 16, torch.float16), ForwardMode.DECODE, [1, 1], [3000, 5], False),
        (AttentionConfig(4, 4, 64, 16, torch.float32), ForwardMode.DECODE, [1, 1], [10, 5], False),
    ]
    cases.append((llama, ForwardMode.TARGET_VERIFY, [4, 4], [500, 9], False, True))  # fa3's tree part
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    llama8 = AttentionConfig(32, 8, 128, 16, torch.bfloat16, kv_dtype=e4m3)  # fp8 KV: dequantized on load
    cases += [
        (llama8, ForwardMode.DECODE, [1] * 4, [99, 1999, 32, 700], False),  # splits + merge
        (llama8, ForwardMode.DECODE, [1], [32767], False),  # the small-tile long decode
        (llama8, ForwardMode.DECODE, [1] * 64, [1023] * 64, False),
        (llama8, ForwardMode.EXTEND, [37, 200], [0, 50], True),  # causal prefill, LSE
        (llama8, ForwardMode.TARGET_VERIFY, [8, 8], [300, 40], False),  # tree mask
        (llama8, ForwardMode.TARGET_VERIFY, [4, 4], [500, 9], False, True),  # fa3's tree part on fp8 KV
        (
            AttentionConfig(32, 8, 128, 16, torch.float16, kv_dtype=e5m2),
            ForwardMode.DECODE,
            [1] * 4,
            [99, 1999, 32, 700],
            False,
        ),
        (AttentionConfig(32, 8, 128, 16, torch.bfloat16, kv_dtype=e5m2), ForwardMode.EXTEND, [37, 200], [0, 50], False),
        (
            AttentionConfig(8, 8, 64, 1, torch.float16, "HND", None, 30.0, 63, e5m2),
            ForwardMode.EXTEND,
            [12, 3],
            [100, 2],
            False,
        ),
        (AttentionConfig(8, 2, 256, 16, torch.bfloat16, kv_dtype=e4m3), ForwardMode.EXTEND, [20], [40], False),
    ]
    for cfg, mode, q_lens, prefix, with_lse, *tree in cases:
        c = random_case(mode, q_lens, prefix, cfg, "cpu")
        scales = {}
        if cfg.kv_quantized:  # random_case draws the caches in the model dtype
            c.k_cache, c.v_cache = c.k_cache.to(cfg.kv_dtype), c.v_cache.to(cfg.kv_dtype)
            scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(()))
        attn = PagedAttention(cfg, "triton", "cpu")
        attn.provider._sms = H200_SMS
        extra = {"kv_start": torch.tensor(prefix, dtype=torch.int32), "num_kv_splits": 1} if tree else {}
        attn.plan(c.batch, c.num_pages, **extra)
        out = torch.empty_like(c.q)
        lse = torch.empty(c.q.shape[:2], dtype=torch.float32) if with_lse else None
        attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, **scales)
    record_fast_paths(llama)
    record_sinks()
    record_mla()
    record_ragged()
    if GLUON:
        record_gluon()
    else:  # the provider launches it only within GLUON_TRITON (its Gluon API moved after)
        print(f"gluon_prefill_kernel: not compiled, triton {triton.__version__} is outside {GLUON_TRITON}")
    v = torch.zeros(6, 32, 128, dtype=torch.bfloat16)
    s = torch.zeros(32, 6)
    merge_mod.merge_state(v, s.t(), v, s.t(), v, s.t())  # the fa3 tree merge (transposed LSE)
    for dt, idx in ((torch.bfloat16, torch.int64), (torch.float16, torch.int32)):
        cache = torch.zeros(2, 10, 16, 8, 128, dtype=dt)
        kv = torch.zeros(3, 16, 128, dtype=dt)
        kv_mod.write_kv_paged(kv[:, :8], kv[:, 8:], cache[0], cache[1], torch.zeros(3, dtype=idx))
    for cdt, dt in ((e4m3, torch.bfloat16), (e5m2, torch.float16), (e4m3, torch.float32)):  # quantizing writes
        cache = torch.zeros(2, 10, 16, 8, 128, dtype=cdt)
        kv = torch.zeros(3, 16, 128, dtype=dt)
        kv_mod.write_kv_paged(
            kv[:, :8], kv[:, 8:], cache[0], cache[1], torch.zeros(3, dtype=torch.int64), torch.ones(()), torch.ones(1)
        )
    q = torch.zeros(5, 32, 128, dtype=torch.bfloat16)  # fa3's query quantization
    kv_mod.quantize_fp8_rows(q, torch.ones(()), torch.empty(5, 32, 128, dtype=e4m3))
    kv_mod.quantize_fp8_rows(q, torch.ones(()), torch.empty(5, 32, 128, dtype=e4m3), torch.empty_like(q))  # + tree q
    for mode, q in (("decode", 1), ("verify", 4)):  # vLLM: page table; chain mask
        gs = GraphState(llama, "triton", 8, 8 * q, 800, "cpu", mode, num_draft_tokens=q, max_seq_len=1600)
        gs.plans[4] = None  # replay metadata only: no attention plan needed
        gs.update_from_block_table(torch.zeros(4, dtype=torch.int32), torch.zeros(4, 100, dtype=torch.int32), 4)
    gs = GraphState(llama, "triton", 8, 8, 800, "cpu", "decode", max_seq_len=1600)
    gs.plans[4] = None  # SGLang: token-slot table + row ids
    gs.update_from_block_table(
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(5, 1600, dtype=torch.int32),
        4,
        row_ids=torch.zeros(3, dtype=torch.int64),
        entry_tokens=16,
    )
    record_cascade_graph(llama)
    i32 = torch.zeros(64, dtype=torch.int32)  # FA3's block table output
    graph_mod.graph_batch_from_block_table(
        i32[:4],
        i32.view(4, 16),
        4,
        16,
        0,
        1,
        i32,
        i32,
        i32,
        i32,
        block_table_out=torch.zeros(4, 16, dtype=torch.int32),
        max_batch=8,
    )


def record_cascade_graph(llama) -> None:
    """Decode and verify graphs with cascade: the shared-pages search and the suffix / prefix update (page
    table and token-slot table; verify: chain masks and SGLang's tree masks), then the replayed launches
    (suffix, split prefix part, merges) planned for the H200's SM count."""
    import attnplug.core.providers.triton as triton_provider_mod

    num_sms = triton_provider_mod._num_sms
    triton_provider_mod._num_sms = lambda device: H200_SMS
    key = tiles.key(llama.head_dim, llama.group_size, "noncausal")
    saved = dict(tiles.TILES)
    try:
        # the table's prefix tiles, then the paged and the prefill kernel as the prefix part (split-KV)
        for entry in (
            None,
            {"kernel": "prefill", "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
            {"kernel": "paged", "block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2},
        ):
            if entry is not None:
                tiles.TILES[key] = entry
            gs = GraphState(llama, "triton", 64, 64, 64 * 530, "cpu", "decode", max_seq_len=8464, cascade="always")
            gs.prepare_capture(64)
            assert gs.cascade.plans[64].state.kernel == (entry or tiles.TILES[key]).get("kernel", "paged")
            gs.update_from_block_table(torch.zeros(4, dtype=torch.int32), torch.zeros(4, 100, dtype=torch.int32), 64)
            gs.update_from_block_table(
                torch.zeros(3, dtype=torch.int64),
                torch.zeros(5, 1600, dtype=torch.int32),
                64,
                row_ids=torch.zeros(3, dtype=torch.int64),
                entry_tokens=16,
            )
            q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)
            cache = torch.zeros(64 * 530 + 64, 16, 8, 128, dtype=torch.bfloat16)
            gs.run(64, q, cache, cache, torch.empty_like(q))
        for chain in (True, False):  # verify graphs with cascade: vLLM's chain drafts, SGLang's tree drafts
            gs = GraphState(
                llama, "triton", 16, 64, 16 * 530, "cpu", "verify", 4, max_seq_len=8464, cascade="always", chain=chain
            )
            gs.prepare_capture(16)
            tree = None if chain else torch.ones(4 * 4 * 200, dtype=torch.bool)
            seq, table = torch.full((4,), 200, dtype=torch.int32), torch.zeros(4, 100, dtype=torch.int32)
            gs.update_from_block_table(seq, table, 16, custom_mask=tree)
            q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)
            cache = torch.zeros(16 * 530 + 64, 16, 8, 128, dtype=torch.bfloat16)
            gs.run(16, q, cache, cache, torch.empty_like(q))
    finally:
        triton_provider_mod._num_sms = num_sms
        tiles.TILES.clear()
        tiles.TILES.update(saved)


def record_fast_paths(llama) -> None:
    """The Hopper paths (kernels/prefill.py, kernels/decode.py) at the configurations the H200 sweep
    (benchmarks/sweep_triton.py) chooses among, forced through the tile table."""
    d = lambda c, b: tiles.key(c.head_dim, c.group_size, b)  # noqa: E731
    pf = lambda bm, bn, w, st, **kw: {
        "kernel": "prefill",
        "block_m": bm,
        "block_n": bn,
        "num_warps": w,  # noqa: E731
        "num_stages": st,
        **kw,
    }
    dec = lambda bn, w, st, **kw: {"kernel": "decode", "block_n": bn, "num_warps": w, "num_stages": st, **kw}  # noqa: E731
    e4m3 = torch.float8_e4m3fn
    d64, d256 = AttentionConfig(32, 8, 64, 16, torch.bfloat16), AttentionConfig(16, 8, 256, 16, torch.bfloat16)
    page64 = AttentionConfig(32, 8, 128, 64, torch.bfloat16)
    fp8 = AttentionConfig(32, 8, 128, 16, torch.bfloat16, kv_dtype=e4m3)
    runs = [  # (config, mode, q lens, prefix lens, with LSE, table entries)
        (llama, ForwardMode.EXTEND, [300, 200], [0, 250], True, {d(llama, "prefill"): pf(128, 64, 8, 5)}),
        (llama, ForwardMode.EXTEND, [300, 200], [0, 250], False, {d(llama, "prefill"): pf(128, 128, 8, 5, diag_n=64)}),
        (llama, ForwardMode.EXTEND, [300, 200], [0, 250], False, {d(llama, "prefill"): pf(128, 64, 4, 3)}),
        (llama, ForwardMode.EXTEND, [300, 200], [0, 250], False, {d(llama, "prefill"): pf(128, 64, 8, 5, diag_n=0)}),
        (page64, ForwardMode.EXTEND, [300], [100], False, {d(page64, "prefill"): pf(128, 64, 8, 5, tma=True)}),
        (
            AttentionConfig(32, 8, 128, 16, torch.bfloat16, kv_dtype=e4m3),
            ForwardMode.EXTEND,
            [300],
            [40],
            False,
            {d(llama, "prefill"): pf(128, 64, 8, 5)},
        ),
        (d64, ForwardMode.EXTEND, [300], [0], False, {d(d64, "prefill"): pf(128, 64, 4, 5)}),
        (d256, ForwardMode.EXTEND, [300], [0], False, {d(d256, "prefill"): pf(64, 32, 4, 5)}),
        (
            llama,
            ForwardMode.DECODE,
            [1],
            [32767],
            False,
            {d(llama, "decode_tiny"): dec(64, 4, 5, ctas_per_sm=2, fused_merge=True)},
        ),
        (
            llama,
            ForwardMode.DECODE,
            [1] * 4,
            [32767] * 4,
            True,
            {d(llama, "decode_split"): dec(128, 4, 5, ctas_per_sm=2)},
        ),
        (
            llama,
            ForwardMode.DECODE,
            [1] * 4,
            [32767] * 4,
            True,
            {
                d(llama, "decode_split"): dec(
                    128, 4, 5, ctas_per_sm=2, fused_merge=True, whole_waves=True, min_split_keys=512
                )
            },
        ),
        # the paged kernel split (the any-group decode_split seed: other GQA groups)
        (
            llama,
            ForwardMode.DECODE,
            [1] * 4,
            [32767] * 4,
            False,
            {
                d(llama, "decode_split"): {
                    "kernel": "paged",
                    "block_n": 128,
                    "num_warps": 4,
                    "num_stages": 3,
                    "ctas_per_sm": 2,
                }
            },
        ),
        (llama, ForwardMode.DECODE, [1] * 64, [4095] * 64, False, {d(llama, "decode"): dec(64, 4, 7)}),
        (
            AttentionConfig(32, 8, 128, 16, torch.float16, "NHD", None, 30.0, 1000, e4m3),
            ForwardMode.DECODE,
            [1],
            [5000],
            False,
            {d(llama, "decode_tiny"): dec(64, 2, 5, ctas_per_sm=4, fused_merge=True)},
        ),
        (
            d256,
            ForwardMode.DECODE,
            [1],
            [32767],
            False,
            {d(d256, "decode_tiny"): dec(64, 4, 5, ctas_per_sm=2, fused_merge=True)},
        ),
        (
            fp8,
            ForwardMode.DECODE,
            [1] * 64,
            [4095] * 64,
            False,
            {d(llama, "decode") + "/fp8": dec(64, 4, 5, fp8_f16=True)},
        ),
        (fp8, ForwardMode.EXTEND, [300], [40], False, {d(llama, "prefill") + "/fp8": pf(128, 64, 8, 5, fp8_f16=True)}),
        (
            fp8,
            ForwardMode.DECODE,
            [1] * 64,
            [4095] * 64,
            False,
            {
                d(llama, "decode") + "/fp8": {
                    "kernel": "paged",
                    "block_n": 128,
                    "num_warps": 4,
                    "num_stages": 3,
                    "fp8_f16": True,
                }
            },
        ),
        (
            fp8,
            ForwardMode.DECODE,
            [1],
            [32767],
            True,
            {d(llama, "decode_tiny") + "/fp8": dec(128, 4, 5, ctas_per_sm=1, fused_merge=True, fp8_f16=True)},
        ),
        # fp8 byte pairs: the inline-asm split (fp16 dots), the integer split (bf16 dots, e5m2), a full batch split
        (
            fp8,
            ForwardMode.DECODE,
            [1] * 64,
            [4095] * 64,
            False,
            {d(llama, "decode") + "/fp8": dec(64, 2, 5, fp8_f16=True, pairs=True)},
        ),
        (
            AttentionConfig(32, 8, 128, 16, torch.bfloat16, kv_dtype=torch.float8_e5m2),
            ForwardMode.DECODE,
            [1] * 4,
            [32767] * 4,
            True,
            {d(llama, "decode_split"): dec(128, 4, 5, ctas_per_sm=2, fused_merge=True, pairs=True)},
        ),
        (
            fp8,
            ForwardMode.DECODE,
            [1] * 64,
            [4095] * 64,
            False,
            {d(llama, "decode") + "/fp8": dec(64, 2, 5, fp8_f16=True, pairs=True, ctas_per_sm=4, fused_merge=True)},
        ),
        # more programs than four an SM (67 x 8 KV heads > 4 x 132): the decode_wide entry's one-warp pairs
        (
            fp8,
            ForwardMode.DECODE,
            [1] * 67,
            [300] * 67,
            False,
            {d(llama, "decode_wide") + "/fp8": dec(32, 1, 6, fp8_f16=True, pairs=True)},
        ),
        (
            AttentionConfig(32, 8, 128, 16, torch.float16, kv_dtype=torch.float8_e5m2),
            ForwardMode.DECODE,
            [1],
            [32767],
            False,
            {d(llama, "decode_tiny"): dec(128, 4, 5, ctas_per_sm=2, fused_merge=True, pairs=True)},
        ),
    ]
    record_runs(runs)


def record_runs(runs, sinks: bool = False) -> None:
    """Plan and run each ``(config, mode, q lens, prefix lens, with LSE, table entries)`` with its entries
    in the tile table (the planned kernel must be theirs) and the H200's SM count; ``sinks``: zero sinks."""
    for cfg, mode, q_lens, prefix, with_lse, entries in runs:
        if cfg.kv_quantized:  # fp8 configs read the table's fp8 entries first: force those
            entries = {k if k.endswith("/fp8") else k + "/fp8": v for k, v in entries.items()}
        c = random_case(mode, q_lens, prefix, cfg, "cpu")
        scales = dict(sinks=torch.zeros(cfg.num_qo_heads)) if sinks else {}
        if cfg.kv_quantized:
            c.k_cache, c.v_cache = c.k_cache.to(cfg.kv_dtype), c.v_cache.to(cfg.kv_dtype)
            scales.update(k_scale=torch.ones(1), v_scale=torch.ones(()))
        saved = dict(tiles.TILES)
        tiles.TILES.update(entries)
        try:
            attn = PagedAttention(cfg, "triton", "cpu")
            attn.provider._sms = H200_SMS
            plan = attn.plan(c.batch, c.num_pages)
        finally:
            tiles.TILES.clear()
            tiles.TILES.update(saved)
        if entries:
            assert plan.state.kernel == next(iter(entries.values()))["kernel"], (cfg, plan.state.kernel)
        out = torch.empty_like(c.q)
        lse = torch.empty(c.q.shape[:2], dtype=torch.float32) if with_lse else None
        attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, **scales)


def record_gluon() -> None:
    """The Gluon prefill kernels (kernels/gluon_prefill.py): the table's configurations as the provider plans
    them on sm90 (head_dim 64 / 128, GQA groups 1 to 8, bf16 and fp16, NHD and HND pages, with and without LSE,
    prefill and extend; the plan must pick Gluon, ``_gluon`` set as on an sm90 GPU), then, at head_dim 64 /
    128 / 256, every configuration the probe times (``SINGLE_PARTITION``, ``WS_CANDIDATES``) put in the table."""
    bf, fp = torch.bfloat16, torch.float16
    cases = [  # (config, q lens, prefix lens, with LSE)
        (AttentionConfig(32, 8, 128, 16, bf), [300, 200], [0, 250], False),
        (AttentionConfig(32, 8, 128, 16, bf), [300], [40], True),
        (AttentionConfig(32, 32, 128, 16, bf), [200], [0], False),  # MHA
        (AttentionConfig(64, 8, 128, 16, fp, "HND"), [130], [17], False),  # group 8, fp16, HND
        (AttentionConfig(32, 8, 64, 16, bf), [300], [0], False),
        (AttentionConfig(32, 8, 64, 16, fp), [300], [5], True),
        (AttentionConfig(16, 8, 256, 16, bf), [300], [0], False),  # no table entry: probe configurations only
        (AttentionConfig(32, 2, 256, 16, bf, "HND"), [100], [64], True),  # group 16
    ]

    def run(n: int, table: tuple | None = None) -> None:
        cfg, q_lens, prefix, with_lse = cases[n]
        product = gluon_mod.CONFIGS.get(cfg.head_dim)
        if table is not None:
            gluon_mod.CONFIGS[cfg.head_dim] = table
        try:
            c = random_case(ForwardMode.EXTEND, q_lens, prefix, cfg, "cpu")
            attn = PagedAttention(cfg, "triton", "cpu")
            attn.provider._sms, attn.provider._gluon = H200_SMS, True
            plan = attn.plan(c.batch, c.num_pages)
            a = plan.state
            want = table or product
            assert a.kernel == "gluon" and (a.loaders, a.pingpong) == want[5:], (cfg, want, a)
            out = torch.empty_like(c.q)
            lse = torch.empty(c.q.shape[:2], dtype=torch.float32) if with_lse else None
            attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse)
            if table is None and n in (0, 4):  # a query 2 bytes off 16-byte alignment: the Triton prefill fallback
                q = torch.empty(c.q.numel() + 1, dtype=c.q.dtype)[1:].view(c.q.shape)
                attn.run(q, c.k_cache, c.v_cache, out=out, lse=lse)
        finally:
            if product is None:
                gluon_mod.CONFIGS.pop(cfg.head_dim, None)
            else:
                gluon_mod.CONFIGS[cfg.head_dim] = product

    for n in range(6):  # the table's (head dims 64, 128)
        run(n)
    for n in (0, 1, 3, 4, 6, 7):  # the probe's alternatives
        d = cases[n][0].head_dim
        for table in (gluon_mod.SINGLE_PARTITION[d], *gluon_mod.WS_CANDIDATES[d]):
            if table != gluon_mod.CONFIGS.get(d):
                run(n, table)
    for name in ("gluon_prefill_kernel", "gluon_prefill_ws_kernel"):
        assert any(k[0] == name for k in LAUNCHES), f"{name} launches not recorded"


def record_sinks() -> None:
    """The sink variants (``HAS_SINKS``) of every kernel at gpt-oss's shape (64 / 8 heads, d64), window
    128 and full: the paged kernel unsplit and split (the sink in merge_splits), tree verify, fp8 KV, the
    prefill kernel and the decode kernel (fused and separate merges) forced through the tile table, and
    the fold kernel (``apply_sinks``: the cascade's join and providers without sinks of their own)."""
    e4m3 = torch.float8_e4m3fn
    d = lambda c, b: tiles.key(c.head_dim, c.group_size, b)  # noqa: E731
    dec = lambda **kw: {"kernel": "decode", "block_n": 64, "num_warps": 4, "num_stages": 5, **kw}  # noqa
    runs = []  # (config, mode, q lens, prefix lens, with LSE, table entries)
    for w in (-1, 127):
        g = AttentionConfig(64, 8, 64, 16, torch.bfloat16, window_left=w, sinks=True)
        g8 = AttentionConfig(64, 8, 64, 16, torch.bfloat16, window_left=w, sinks=True, kv_dtype=e4m3)
        runs += [
            (g, ForwardMode.DECODE, [1] * 64, [1023] * 64, False, {}),  # unsplit
            (g, ForwardMode.DECODE, [1] * 4, [99, 1999, 32, 700], True, {}),  # split; the merge's sink
            (g, ForwardMode.EXTEND, [37, 200], [0, 50], True, {}),
            (g, ForwardMode.TARGET_VERIFY, [8, 8], [300, 40], False, {}),
            (g8, ForwardMode.DECODE, [1] * 4, [99, 1999, 32, 700], False, {}),
            (g8, ForwardMode.EXTEND, [37, 200], [0, 50], False, {}),
            (
                g,
                ForwardMode.DECODE,
                [1] * 4,
                [32767] * 4,
                True,
                {d(g, "decode_split"): dec(ctas_per_sm=2, fused_merge=True)},
            ),
            (g, ForwardMode.DECODE, [1] * 4, [32767] * 4, False, {d(g, "decode_split"): dec(ctas_per_sm=2)}),
            (g, ForwardMode.DECODE, [1] * 64, [4095] * 64, False, {d(g, "decode"): dec()}),
        ]
    full = AttentionConfig(64, 8, 64, 16, torch.bfloat16, sinks=True)
    pf = {"kernel": "prefill", "block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    runs.append((full, ForwardMode.EXTEND, [300, 17], [0, 0], True, {d(full, "prefill"): pf}))
    record_runs(runs, sinks=True)
    for dt in (torch.bfloat16, torch.float16):  # the fold: bf16 sinks too; fa3's transposed LSE
        o, s = torch.zeros(6, 64, 64, dtype=dt), torch.zeros(64, 6)
        merge_mod.apply_sinks(o, s.t(), torch.zeros(64, dtype=dt))
        merge_mod.apply_sinks(o, s.t().contiguous(), torch.zeros(64))


def record_mla() -> None:
    """MLA (DeepSeek latent 512 + rope 64, 128 and 16 heads a GPU, page 64): the absorbed kernel in every
    mode (decode unsplit and split with the merge, extend, chain and tree verify, LSE, fp8 latent, fa3's tree
    part from ``kv_start``) and the latent write (16-bit and quantizing)."""
    from attnplug.core.mla import latent_cache_views, mla_config, write_latent  # noqa: PLC0415

    e4m3 = torch.float8_e4m3fn
    runs = []  # (heads, kv dtype, mode, q lens, prefix lens, with LSE, knobs)
    for h in (128, 16):
        runs += [
            (h, None, ForwardMode.DECODE, [1] * 64, [4095] * 64, False, {}),
            (h, None, ForwardMode.DECODE, [1], [32767], True, {}),
            (h, None, ForwardMode.EXTEND, [300, 17], [0, 40], False, {}),
            (h, None, ForwardMode.TARGET_VERIFY, [4, 4], [300, 40], True, {}),
        ]
    runs += [
        (16, e4m3, ForwardMode.DECODE, [1] * 4, [99, 1999, 32, 700], False, {}),
        (
            16,
            None,
            ForwardMode.TARGET_VERIFY,
            [4, 4],
            [300, 40],
            True,
            {"kv_start": torch.tensor([300, 40], dtype=torch.int32), "num_kv_splits": 1},
        ),
    ]
    for h, kv_dtype, mode, q_lens, prefix, with_lse, knobs in runs:
        cfg = mla_config(h, page_size=64, kv_dtype=kv_dtype)
        c = random_case(mode, q_lens, prefix, mla_config(h, page_size=64), "cpu")
        cache = c.k_cache.to(cfg.kv_dtype)
        k, v = latent_cache_views(cache, cfg)
        attn = PagedAttention(cfg, "triton", "cpu")
        attn.provider._sms = H200_SMS
        attn.plan(c.batch, c.num_pages, **knobs)
        lse = torch.empty(c.q.shape[:2], dtype=torch.float32) if with_lse else None
        attn.run(c.q, k, v, lse=lse, **({"k_scale": torch.ones(1)} if kv_dtype else {}))
    for cdt in (torch.bfloat16, e4m3):
        cache = torch.zeros(10, 64, 576, dtype=cdt)
        kv_c, k_pe = torch.zeros(3, 512, dtype=torch.bfloat16), torch.zeros(3, 1, 64, dtype=torch.bfloat16)
        scale = torch.ones(1) if cdt == e4m3 else None
        write_latent(kv_c, k_pe, cache, torch.zeros(3, dtype=torch.int64), scale)


def record_ragged() -> None:
    """The cache-free prefill (SGLang's MLA prefill: qk 192 / v 128, 16 and 128 heads; GQA d128), causal and not."""
    from attnplug.core.ragged import RaggedAttention, RaggedConfig  # noqa: PLC0415

    for hq, hkv, d, dv, causal in ((16, 16, 192, 128, True), (128, 128, 192, 128, True), (32, 8, 128, 128, False)):
        attn = RaggedAttention(RaggedConfig(hq, hkv, d, dv, torch.bfloat16), "triton", "cpu")
        attn.plan([300, 17], [300, 57], causal=causal)
        q = torch.zeros(317, hq, d, dtype=torch.bfloat16)
        attn.run(q, torch.zeros(357, hkv, d, dtype=torch.bfloat16), torch.zeros(357, hkv, dv, dtype=torch.bfloat16))


def cuobjdump(cubin: bytes, *args: str) -> str:
    """The output of ``cuobjdump ARGS`` (Triton's NVIDIA backend ships it) on a cubin, or ``""``."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            return subprocess.run([tool, *args, f.name], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return ""


def resource_usage(cubin: bytes) -> str:
    """``REG:.. STACK:.. SHARED:..`` of a cubin (``cuobjdump -res-usage``), or ``?``."""
    import re

    m = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+", cuobjdump(cubin, "-res-usage"))
    return m.group(0) if m else "?"


def wgmma_serialized(ptx: str) -> str:
    """ptxas's verbose notes on a kernel's PTX that say its wgmmas were serialized (``C7514`` / ``C7515``: an
    accumulator read while in flight, a loop edge crossed by one), or ``""``: a Gluon kernel written for
    overlapped wgmmas must not lose it silently."""
    import re
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [tool, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    notes = (r.stdout + r.stderr).splitlines()
    return "\n".join(line for line in notes if re.search(r"C751[45]|serialized", line))


def main() -> None:
    record_all()
    target = GPUTarget("cuda", 90, 32)
    kinds = {}
    stats = "--stats" in sys.argv  # registers / stack (spills) / static shared memory of each launch
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    shard, shards = map(int, sys.argv[sys.argv.index("--shard") + 1].split("/")) if "--shard" in sys.argv else (0, 1)
    recorded = Counter(name for name, *_ in LAUNCHES)
    print("recorded " + " ".join(f"{k}={n}" for k, n in sorted(recorded.items())))
    for i, key in enumerate(sorted(LAUNCHES, key=repr)):
        fn, sig, const, opts, attrs = LAUNCHES[key]
        if (only is not None and fn.__name__ != only) or i % shards != shard:
            continue
        gluon = getattr(fn, "is_gluon", lambda: False)()
        src = (GluonASTSource if gluon else ASTSource)(fn=fn, signature=sig, constexprs=const, attrs=attrs)
        k = triton.compile(src, target=target, options=opts)
        cubin = k.asm["cubin"]
        assert len(cubin) > 1000, (fn.__name__, len(cubin))
        kinds[fn.__name__] = kinds.get(fn.__name__, 0) + 1
        if gluon:
            serialized = wgmma_serialized(k.asm["ptx"])
            assert not serialized, (fn.__name__, const, serialized)
        if stats:
            names = fn.arg_names
            show = {
                names[i[0]]: v for i, v in const.items() if names[i[0]].isupper() and names[i[0]] not in ("UPCAST",)
            }
            print(f"{fn.__name__} {opts} {resource_usage(cubin)} smem {k.metadata.shared} {show}", flush=True)
    print(" ".join(f"{k}={n}" for k, n in sorted(kinds.items())))
    part = f" (shard {shard}/{shards} of {len(LAUNCHES)})" if shards > 1 else ""
    print(f"compiled {sum(kinds.values())} distinct launches for sm90{part}")


if __name__ == "__main__":
    main()
