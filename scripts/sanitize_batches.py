"""The kernel test batches, for ``compute-sanitizer --tool memcheck`` (issue 17 §3): run by
``scripts/sanitize_gpu.sh``; plain Python (no pytest) so that the sanitizer sees one short process.

Per provider available on the GPU (triton, flashinfer, fa3): ragged batches (empty requests, requests
without queries, mid-page ends) in decode / extend / mixed / tree-verify at page sizes 1 and 16;
16k-token contexts (decode 2 x 16384, extend 1 x (16384 + 512), verify 2 x (16384 + 8 tree)); then
CUDA-graph replays with padding (decode and verify, bs 1..4, real batches B < bs), both update paths.
Every output is compared with the float32 reference (a wrong result is reported, the sanitizer
reports the memory errors). ``--quick``: fewer shapes. Exit 1 when a check fails or a provider that
should load does not.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention, UnsupportedFeature
from attnplug.core import pages as pg
from attnplug.core.cuda_graph import GraphState
from attnplug.core.draft import build_tree_verify_mask
from attnplug.core.plan import make_plan
from attnplug.core.providers import ProviderUnavailable, available_providers
from attnplug.core.reference import reference_attention

DEV = torch.device("cuda")  # --device cpu: a dry run through the Triton interpreter (no sanitizer)
FAILS: list[str] = []


def batch(mode: ForwardMode, q_lens, prefix, P: int, num_pages: int, g: torch.Generator) -> BatchMetadata:
    """Pages drawn at random from 1..num_pages-1 (page 0 is the graphs' pad page)."""
    kv = torch.tensor([p + q for p, q in zip(prefix, q_lens)], dtype=torch.int32)
    npg = pg.num_pages(kv, P)
    page_ids = (torch.randperm(num_pages - 1, generator=g)[: int(npg.sum())] + 1).to(torch.int32)
    qo = pg.indptr_from_counts(torch.tensor(list(q_lens), dtype=torch.int32))
    mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        parents = []
        for q in q_lens:
            parents.append([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, q)])
        qmax = max(q_lens)
        par = torch.tensor([p + [-1] * (qmax - len(p)) for p in parents])
        if len(set(q_lens)) == 1:
            mask = build_tree_verify_mask(par, torch.tensor(prefix))
        else:  # ragged trees: all-visible prefix, causal chain over the drafts
            blocks = []
            for q, k in zip(q_lens, kv.tolist()):
                m = torch.ones(q, k, dtype=torch.bool)
                m[:, k - q :] = torch.tril(torch.ones(q, q, dtype=torch.bool))
                blocks.append(m.flatten())
            mask = torch.cat(blocks)
    return BatchMetadata(mode, qo, pg.indptr_from_counts(npg), page_ids, pg.last_page_len(kv, P), custom_mask=mask)


def check(tag: str, out: torch.Tensor, cfg, b: BatchMetadata, q, k, v, num_pages: int) -> None:
    ref, _ = reference_attention(make_plan(cfg, b, num_pages=num_pages, device=DEV), q, k, v)
    err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-6))
    ok = err < 2e-2 and bool(torch.isfinite(out).all())
    print(f"  {tag}: rel err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    if not ok:
        FAILS.append(tag)


def eager(provider: str, quick: bool) -> None:
    g = torch.Generator().manual_seed(0)
    cases = []
    for P in (1, 16):
        cases += [
            (ForwardMode.DECODE, [1, 1, 1, 1, 1], [0, 7, 33, 100, 15], P),
            (ForwardMode.EXTEND, [5, 0, 17, 1, 64], [0, 9, 40, 0, 100], P),
            (ForwardMode.MIXED, [1, 30, 1, 0, 3], [50, 0, 7, 12, 31], P),
            (ForwardMode.TARGET_VERIFY, [4, 4, 4], [0, 37, 120], P),
            (ForwardMode.TARGET_VERIFY, [6, 2, 5], [10, 3, 64], P),
        ]
    cases += [
        (ForwardMode.DECODE, [1, 1], [16383, 16000], 16),
        (ForwardMode.EXTEND, [512], [16384], 16),
        (ForwardMode.TARGET_VERIFY, [8, 8], [16384, 16001], 16),
    ]
    if quick:
        cases = cases[:3] + cases[-3:]
    for mode, q_lens, prefix, P in cases:
        cfg = AttentionConfig(8, 2, 128, P, torch.bfloat16)
        need = sum(-(-(p + q) // P) for p, q in zip(prefix, q_lens))
        num_pages = need + 9
        b = batch(mode, q_lens, prefix, P, num_pages, g)
        shape = cfg.kv_cache_shape(num_pages)
        k = torch.randn(shape, generator=g).to(cfg.dtype).to(DEV)
        v = torch.randn(shape, generator=g).to(cfg.dtype).to(DEV)
        q = torch.randn(sum(q_lens), cfg.num_qo_heads, cfg.head_dim, generator=g).to(cfg.dtype).to(DEV)
        tag = f"{provider} {mode.name} page {P} q {q_lens} prefix {prefix}"
        try:
            attn = PagedAttention(cfg, provider, DEV)
            attn.plan(b, num_pages=num_pages)
            out = attn.run(q, k, v)
            if DEV.type == "cuda":
                torch.cuda.synchronize()
        except UnsupportedFeature as e:
            print(f"  {tag}: refused ({e})", flush=True)
            continue
        check(tag, out, cfg, b, q, k, v, num_pages)


def graphs(provider: str, quick: bool) -> None:
    g = torch.Generator().manual_seed(1)
    cfg = AttentionConfig(8, 2, 128, 16, torch.bfloat16)
    num_pages, max_bs, nd = 256, 4, 4
    shape = cfg.kv_cache_shape(num_pages)
    k = torch.randn(shape, generator=g).to(cfg.dtype).to(DEV)
    v = torch.randn(shape, generator=g).to(cfg.dtype).to(DEV)
    for mode in ("decode", "verify"):
        qn = 1 if mode == "decode" else nd
        try:
            gs = GraphState(
                cfg,
                provider,
                max_batch=max_bs,
                max_tokens=max_bs * qn,
                max_pages=num_pages - 1,
                device=DEV,
                mode=mode,
                num_draft_tokens=nd,
                pad_page=0,
                max_seq_len=200,
            )
        except UnsupportedFeature as e:
            print(f"  {provider} graphs {mode}: refused ({e})", flush=True)
            continue
        q_in = torch.zeros(max_bs * qn, cfg.num_qo_heads, cfg.head_dim, dtype=cfg.dtype, device=DEV)
        out = torch.zeros_like(q_in)
        captured = {}
        for bs in range(1, max_bs + 1):
            gs.prepare_capture(bs)
            if DEV.type != "cuda":
                captured[bs] = None
                continue
            gs.run(bs, q_in[: bs * qn], k, v, out[: bs * qn])  # warm up outside capture
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                gs.run(bs, q_in[: bs * qn], k, v, out[: bs * qn])
            captured[bs] = cg
        for bs in range(1, max_bs + 1):
            for B in sorted({1, bs - 1 or 1, bs}):
                fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.TARGET_VERIFY
                prefix = torch.randint(0, 150, (B,), generator=g).tolist()
                b = batch(fm, [qn] * B, prefix, 16, num_pages, g)
                q = torch.randn(B * qn, cfg.num_qo_heads, cfg.head_dim, generator=g).to(cfg.dtype).to(DEV)
                q_in[: B * qn].copy_(q)
                if mode == "decode" and B % 2 == 0 and not gs.needs_host_lengths:  # the one-launch update
                    seq = (b.kv_indptr[1:] - b.kv_indptr[:-1] - 1) * 16 + b.kv_last_page_len
                    table = torch.zeros(B, 16, dtype=torch.int32)
                    for i in range(B):
                        pg = b.kv_indices[b.kv_indptr[i] : b.kv_indptr[i + 1]]
                        table[i, : pg.numel()] = pg
                    gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs, host_seq_lens=seq)
                else:
                    gs.update(b, bs)
                if captured[bs] is None:
                    gs.run(bs, q_in[: bs * qn], k, v, out[: bs * qn])
                else:
                    captured[bs].replay()
                    torch.cuda.synchronize()
                check(f"{provider} graph {mode} bs {bs} B {B}", out[: B * qn], cfg, b, q, k, v, num_pages)
            if quick:
                break


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--providers", default="", help="comma list (default: every provider available on cuda)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (Triton interpreter)")
    ap.add_argument("--parts", default="eager,graphs", help="which parts (eager: the batches, graphs: the replays)")
    args = ap.parse_args()
    global DEV
    DEV = torch.device(args.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("sanitize_batches: needs CUDA", file=sys.stderr)
        return 2
    names = args.providers.split(",") if args.providers else available_providers(DEV)
    names = [n for n in names if n != "reference"]
    where = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(f"sanitize_batches: providers {names} on {where}", flush=True)
    for name in names:
        t0 = time.time()
        for part in [p for p in (eager, graphs) if p.__name__ in args.parts.split(",")]:
            try:
                part(name, args.quick)
            except ProviderUnavailable as e:
                FAILS.append(f"{name} unavailable: {e}")
            except Exception:  # noqa: BLE001 - reported, the sanitizer run goes on
                FAILS.append(f"{name} {part.__name__}: {traceback.format_exc()[-1500:]}")
                print(FAILS[-1], flush=True)
        print(f"sanitize_batches: {name} done in {time.time() - t0:.0f} s", flush=True)
    print(f"sanitize_batches: {len(FAILS)} failed checks", flush=True)
    for f in FAILS:
        print("  FAILED:", f.splitlines()[0])
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
