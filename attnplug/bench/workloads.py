"""Benchmark rows: shapes, random paged inputs, byte / FLOP counts and the reference check."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..core import AttentionConfig, BatchMetadata, ForwardMode, make_plan
from ..core.plan import Plan
from ..core.reference import reference_attention


@dataclass(frozen=True)
class Row:
    """One benchmark shape: request ``b`` has ``prefix`` cached tokens then ``q_len`` new ones."""

    name: str
    kind: str  # "decode" | "prefill" | "verify"
    batch: int
    q_len: int
    prefix: int
    shared: int = 0  # leading prefix tokens all requests share (engine layout: same page ids), else 0
    kv: str = ""  # "fp8": an fp8 (e4m3) KV cache with per-layer scales, else the model dtype
    heads: tuple[int, ...] = ()  # (q heads, KV heads, head dim) of this row, else the run's config
    layout: str = ""  # the cache layout of this row ("HND": [pages, Hkv, P, D]), else the run's config
    mla: tuple[int, ...] = ()  # MLA row (attnplug.bench.mla): (q heads, kv_lora_rank, rope dim)

    @property
    def cascade_row(self) -> bool:
        """A shared-prefix row, or its unshared twin: attnplug runs with cascade on and off."""
        return self.shared > 0 or self.name.endswith("unshared")

    @property
    def mode(self) -> ForwardMode:
        return {"decode": ForwardMode.DECODE, "prefill": ForwardMode.EXTEND, "verify": ForwardMode.TARGET_VERIFY}[
            self.kind
        ]

    @property
    def metric(self) -> str:
        return "TFLOP/s" if self.kind == "prefill" else "GB/s"


# Llama-3-8B attention: 32 q heads, 8 KV heads, head dim 128, page 16, bf16
FULL_CONFIG = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
FULL_ROWS = [
    Row("decode 64x4096", "decode", 64, 1, 4095),
    Row("decode 16x16384", "decode", 16, 1, 16383),
    Row("decode 128x2048", "decode", 128, 1, 2047),
    Row("decode 1x32768", "decode", 1, 1, 32767),
    Row("decode 4x32768", "decode", 4, 1, 32767),
    Row("prefill 4x4096", "prefill", 4, 4096, 0),
    Row("prefill 1x8192", "prefill", 1, 8192, 0),
    Row("extend 8x(512+4096)", "prefill", 8, 512, 4096),
    Row("verify 32x(4096+64 tree)", "verify", 32, 64, 4096),
    Row("cascade decode 64x(8192+256)", "decode", 64, 1, 8192 + 256, shared=8192),
    Row("decode 64x(8192+256) unshared", "decode", 64, 1, 8192 + 256),
    # fp8 (e4m3) KV cache, q and output bf16 (issue 15): compare with the bf16 rows of the same shape
    Row("decode 64x4096 fp8", "decode", 64, 1, 4095, kv="fp8"),
    Row("decode 1x32768 fp8", "decode", 1, 1, 32767, kv="fp8"),
    Row("prefill 4x4096 fp8", "prefill", 4, 4096, 0, kv="fp8"),
    Row("decode 128x2048 fp8", "decode", 128, 1, 2047, kv="fp8"),
    # the layout vLLM gives attnplug_triton for an fp8 cache (Provider.preferred_kv_layout), and its bf16 twin
    Row("decode 64x4096 HND", "decode", 64, 1, 4095, layout="HND"),
    Row("decode 64x4096 fp8 HND", "decode", 64, 1, 4095, kv="fp8", layout="HND"),
    # head dim 64 (Llama-3.2-1B: 32 q / 8 KV heads) and 256 (Gemma-2-9B: 16 q / 8 KV heads), issue 14
    Row("prefill 4x4096 d64", "prefill", 4, 4096, 0, heads=(32, 8, 64)),
    Row("decode 1x32768 d64", "decode", 1, 1, 32767, heads=(32, 8, 64)),
    Row("decode 4x32768 d64", "decode", 4, 1, 32767, heads=(32, 8, 64)),
    Row("prefill 4x4096 d256", "prefill", 4, 4096, 0, heads=(16, 8, 256)),
    Row("decode 1x32768 d256", "decode", 1, 1, 32767, heads=(16, 8, 256)),
    Row("decode 4x32768 d256", "decode", 4, 1, 32767, heads=(16, 8, 256)),
]
QUICK_CONFIG = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
QUICK_ROWS = [
    Row("decode 4x100", "decode", 4, 1, 99),
    Row("prefill 2x48", "prefill", 2, 48, 0),
    Row("extend 2x(16+40)", "prefill", 2, 16, 40),
    Row("verify 2x(40+8 tree)", "verify", 2, 8, 40),
    Row("cascade decode 6x(64+16)", "decode", 6, 1, 80, shared=64),
    Row("decode 4x100 fp8", "decode", 4, 1, 99, kv="fp8"),
    Row("decode 4x100 fp8 HND", "decode", 4, 1, 99, kv="fp8", layout="HND"),
]
FP8_SCALES = (1 / 64, 1 / 48)  # k, v: N(0, 1) values / scale reach ~300 (e4m3 max 448): the range is used


@dataclass
class Work:
    """Inputs of one row, on the device. ``batch`` holds host metadata (what an engine passes)."""

    row: Row
    config: AttentionConfig
    batch: BatchMetadata
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_pages: int
    block_table: torch.Tensor  # [B, max_pages] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    tree: torch.Tensor | None  # [B, q_len, kv_len] bool (verify), device
    nbytes: int = 0
    flops: float = 0.0
    extra: dict = field(default_factory=dict)


def random_tree_mask(q_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[q_len, q_len]`` bool: draft token ``i`` sees itself and its ancestors (random parents < i)."""
    m = torch.eye(q_len, dtype=torch.bool)
    for i in range(1, q_len):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        m[i] |= m[parent]
    return m


def build_shared(row: Row, config: AttentionConfig, device: torch.device, seed: int = 0) -> Work:
    """A shared-prefix row: every request's prompt starts with the same ``row.shared`` tokens, laid
    out by the core's prefix-caching KV manager (:mod:`attnplug.bench.shared_prefix`)."""
    from ..core.page_table import block_table_from_csr  # noqa: PLC0415
    from .shared_prefix import prompts, shared_prefix_batch  # noqa: PLC0415

    toks = prompts([(row.batch, row.shared)], row.prefix - row.shared, seed=seed)
    batch, q, k, v, num_pages = shared_prefix_batch(config, row.mode, toks, row.q_len, seed, device)
    bt, seq = block_table_from_csr(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, config.page_size)
    esz = torch.empty(0, dtype=config.dtype).element_size()
    kv_tokens = row.shared + row.batch * (row.prefix + row.q_len - row.shared)  # each distinct page once
    nbytes = 2 * q.numel() * esz + 2 * kv_tokens * config.num_kv_heads * config.head_dim * esz
    keys = row.q_len * (row.prefix + row.q_len) - row.q_len * (row.q_len - 1) / 2
    flops = 4.0 * config.num_qo_heads * config.head_dim * keys * row.batch
    return Work(row, config, batch, q, k, v, num_pages, bt.to(device), seq.to(device), None, nbytes, flops)


def _quantize_kv(work: Work) -> Work:
    """An fp8 row: the caches quantized to e4m3 with :data:`FP8_SCALES` (as the KV write stores them),
    the config's ``kv_dtype`` set, the scales in ``work.extra["scales"]`` (device tensors, attnplug's
    ``run``) and ``work.extra["scale_floats"]`` (host floats, FlashInfer's own API); KV bytes at 1 B."""
    from ..core.kv_layout import quantize_fp8  # noqa: PLC0415

    fp8 = torch.float8_e4m3fn
    ks, vs = FP8_SCALES
    dev = work.q.device
    work.config = dataclasses.replace(work.config, kv_dtype=fp8)
    work.k_cache = quantize_fp8(work.k_cache, ks, fp8)
    work.v_cache = quantize_fp8(work.v_cache, vs, fp8)
    work.extra["scales"] = dict(k_scale=torch.tensor([ks], device=dev), v_scale=torch.tensor([vs], device=dev))
    work.extra["scale_floats"] = (ks, vs)
    c = work.config
    kv_bytes = 2 * work.row.batch * (work.row.prefix + work.row.q_len) * c.num_kv_heads * c.head_dim
    esz = torch.empty(0, dtype=c.dtype).element_size()
    work.nbytes = 2 * work.q.numel() * esz + kv_bytes  # q and out in the model dtype, K/V one byte each
    return work


def build(row: Row, config: AttentionConfig, device: torch.device, seed: int = 0) -> Work:
    """Random q / paged KV (random permuted page table) for ``row``."""
    if row.mla:
        from .mla import build_mla  # noqa: PLC0415

        return build_mla(row, config.dtype, device, seed)
    if row.heads:  # this row's own head counts / head dim
        hq, hkv, d = row.heads
        config = dataclasses.replace(config, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=d)
    if row.layout:
        config = dataclasses.replace(config, kv_layout=row.layout)
    if row.kv == "fp8":
        work = build(dataclasses.replace(row, kv=""), config, device, seed)
        work.row = row
        return _quantize_kv(work)
    if row.shared:
        return build_shared(row, config, device, seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    P, B = config.page_size, row.batch
    kv_len = row.prefix + row.q_len
    pages_per = -(-kv_len // P)
    num_pages = B * pages_per
    kv_indices = torch.randperm(num_pages, generator=gen).to(torch.int32)
    kv_indptr = (torch.arange(B + 1, dtype=torch.int32) * pages_per).to(torch.int32)
    last = torch.full((B,), (kv_len - 1) % P + 1, dtype=torch.int32)
    qo_indptr = (torch.arange(B + 1, dtype=torch.int32) * row.q_len).to(torch.int32)
    tree = mask = None
    if row.kind == "verify":
        tree = torch.ones(B, row.q_len, kv_len, dtype=torch.bool)
        for b in range(B):
            tree[b, :, row.prefix :] = random_tree_mask(row.q_len, gen)
        mask = tree.flatten()
        tree = tree.to(device)
    causal = True
    batch = BatchMetadata(row.mode, qo_indptr, kv_indptr, kv_indices, last, custom_mask=mask, causal=causal)
    shape = config.kv_cache_shape(num_pages)
    dt = config.dtype
    k_cache = torch.randn(shape, dtype=dt, device=device)
    v_cache = torch.randn(shape, dtype=dt, device=device)
    q = torch.randn(B * row.q_len, config.num_qo_heads, config.head_dim, dtype=dt, device=device)
    block_table = kv_indices.view(B, pages_per).to(device)
    seq_lens = torch.full((B,), kv_len, dtype=torch.int32, device=device)
    esz = torch.empty(0, dtype=dt).element_size()
    nbytes = 2 * q.numel() * esz + 2 * B * kv_len * config.num_kv_heads * config.head_dim * esz
    # causal (bottom-right) FLOPs: query i of q_len sees prefix + i + 1 keys; QK^T and PV, 2 FLOPs per MAC
    keys = row.q_len * kv_len - row.q_len * (row.q_len - 1) / 2
    flops = 4.0 * config.num_qo_heads * config.head_dim * keys * B
    return Work(row, config, batch, q, k_cache, v_cache, num_pages, block_table, seq_lens, tree, nbytes, flops)


def sub_plan(work: Work, nb: int) -> tuple[Plan, int]:
    """Plan of the first ``nb`` requests (for the reference) and their token count."""
    b = work.batch
    nb = min(nb, work.row.batch)
    t = int(b.qo_indptr[nb])
    pages = int(b.kv_indptr[nb])
    mask = None
    if b.custom_mask is not None:
        kv_len = work.row.prefix + work.row.q_len
        mask = b.custom_mask[: nb * work.row.q_len * kv_len]
    sub = BatchMetadata(
        b.mode,
        b.qo_indptr[: nb + 1],
        b.kv_indptr[: nb + 1],
        b.kv_indices[:pages],
        b.kv_last_page_len[:nb],
        custom_mask=mask,
        causal=b.causal,
    )
    return make_plan(work.config, sub, num_pages=work.num_pages, device=work.q.device), t


def reference(work: Work, nb: int) -> torch.Tensor:
    """Float32 reference output of the first ``nb`` requests: ``[t, Hq, D]`` (fp8 rows: on the
    dequantized cache)."""
    plan, t = sub_plan(work, nb)
    sc = work.extra.get("scales", {})
    out, _ = reference_attention(plan, work.q[:t], work.k_cache, work.v_cache, sc.get("k_scale"), sc.get("v_scale"))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b`` (NaN propagates)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def ref_requests(row: Row) -> int:
    """Requests checked against the float32 reference (it is one request at a time)."""
    return 1 if row.q_len * (row.prefix + row.q_len) > 4096 * 4096 else (2 if row.kind == "prefill" else 4)


def math_isfinite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)
