"""Per-step graph metadata in the vLLM adapter: the previous fixed-shape torch-op translation
(block table -> CSR in ~25 ops, then ``GraphState.update``'s ~12) vs ``GraphState.update_from_block_table``
(one Triton launch), on Llama-3-8B's attention shape, page 16, max 64 requests of <= 16640 tokens.

    python benchmarks/probes/graph_update_bench.py --out benchmarks/results/h200-graph-update-<date>.json

vLLM runs this step eagerly before every graph replay, so its cost is host launches plus device
time: us = wall time of 200 back-to-back updates / 200 (synchronized at the end). Both paths are
first checked to leave the same static buffers. Rows: decode (q=1) and chain verify (q=4), bs 1/8/64.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from attnplug.core import AttentionConfig, BatchMetadata
from attnplug.core.cuda_graph import GraphState

P, MAX_BATCH, MAX_SEQ = 16, 64, 16640


class LegacyRefresh:
    """The adapter's translation before update_from_block_table (attnplug 953dc6f), kept to measure against."""

    def __init__(self, gs: GraphState):
        self.gs, q, dev = gs, gs.q, gs.device
        i32 = dict(dtype=torch.int32, device=dev)
        mb, n = gs.max_batch, gs.max_pages
        self.q, self.pad_kv_len = q, gs.pad_kv_len
        self.seq, self.npg, self.last = (torch.zeros(mb, **i32) for _ in range(3))
        self.padrow = torch.zeros(mb, dtype=torch.bool, device=dev)
        self.indptr = torch.zeros(mb + 1, **i32)
        self.j = torch.arange(n, **i32)
        self.row, self.lin, self.col, self.base, self.idx = (torch.zeros(n, **i32) for _ in range(5))
        self.fill, self.past = (torch.zeros(n, dtype=torch.bool, device=dev) for _ in range(2))
        if q > 1:
            m = gs.max_mask
            self.kl, self.kq = torch.zeros(mb, **i32), torch.zeros(mb, **i32)
            self.mask_indptr = torch.zeros(mb + 1, **i32)
            self.e = torch.arange(m, **i32)
            self.m_row, self.m_off, self.m_kl, self.m_t = (torch.zeros(m, **i32) for _ in range(4))
            self.mask, self.m_fill = (torch.zeros(m, dtype=torch.bool, device=dev) for _ in range(2))

    def __call__(self, seq_lens, block_table, bs):
        pad, n = self.gs.pad_page, seq_lens.shape[0]
        s, padrow, npg, last = self.seq[:bs], self.padrow[:bs], self.npg[:bs], self.last[:bs]
        ind = self.indptr[: bs + 1]
        padrow[n:].fill_(True)
        torch.le(seq_lens, 0, out=padrow[:n])
        s[n:].fill_(0)
        s[:n].copy_(seq_lens)
        s.masked_fill_(padrow, self.pad_kv_len)
        torch.add(s, P - 1, out=npg)
        npg.div_(P, rounding_mode="floor")
        torch.cumsum(npg, 0, dtype=torch.int32, out=ind[1:])
        torch.sub(npg, 1, out=last)
        last.mul_(-P).add_(s)
        row, col, lin = self.row, self.col, self.lin
        torch.searchsorted(ind[1:], self.j, right=True, out_int32=True, out=row)
        row.clamp_(max=bs - 1)
        torch.index_select(ind, 0, row, out=self.base)
        torch.sub(self.j, self.base, out=col)
        w = block_table.shape[1]
        col.clamp_(0, w - 1).mul_(block_table.stride(1))
        torch.clamp(row, max=n - 1, out=lin).mul_(block_table.stride(0)).add_(col)
        span = (n - 1) * block_table.stride(0) + (w - 1) * block_table.stride(1) + 1
        torch.index_select(block_table.as_strided((span,), (1,)), 0, lin, out=self.idx)
        torch.index_select(padrow, 0, row, out=self.fill)
        torch.ge(self.j, ind[bs], out=self.past)
        self.idx.masked_fill_(self.fill.logical_or_(self.past), pad)
        mask = None
        if self.q > 1:
            q, kl, mi = self.q, self.kl[:bs], self.mask_indptr[: bs + 1]
            kl.copy_(s)
            torch.mul(kl, q, out=self.kq[:bs])
            torch.cumsum(self.kq[:bs], 0, dtype=torch.int32, out=mi[1:])
            r, off, k, t = self.m_row, self.m_off, self.m_kl, self.m_t
            torch.searchsorted(mi[1:], self.e, right=True, out_int32=True, out=r)
            r.clamp_(max=bs - 1)
            torch.index_select(mi, 0, r, out=off)
            torch.sub(self.e, off, out=off)
            torch.index_select(kl, 0, r, out=k)
            torch.div(off, k, rounding_mode="floor", out=t)
            t.mul_(k.add_(1))
            torch.sub(off, t, out=t)
            torch.le(t, k.sub_(1 + q), out=self.mask)
            torch.index_select(padrow, 0, r, out=self.m_fill)
            self.mask.logical_or_(self.m_fill)
            mask = self.mask if self.mask.is_cuda else self.mask[: int(mi[bs])]  # CPU: host twins want the length
        gs = self.gs
        gs.update(BatchMetadata(gs.plans[bs].mode, gs.qo_indptr[: bs + 1], ind, self.idx, last, custom_mask=mask), bs)


def per_call_us(fn, reps=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def snapshot(gs: GraphState, bs: int) -> list[torch.Tensor]:
    n = int(gs.kv_indptr[bs])
    out = [
        gs.kv_indptr[: bs + 1].clone(),
        gs.kv_indices[:n].clone(),
        gs.kv_last_page_len[:bs].clone(),
        gs.kv_lens[:bs].clone(),
    ]
    if gs.mode == "verify":
        out += [gs.mask[: int(gs.mask_indptr[bs])].clone(), gs.mask_indptr[: bs + 1].clone(), gs.mask_free[:bs].clone()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = AttentionConfig(32, 8, 128, P, torch.bfloat16)
    W = -(-MAX_SEQ // P)
    g = torch.Generator().manual_seed(0)
    rows = []
    for mode, q in (("decode", 1), ("verify", 4)):
        gs = GraphState(
            cfg,
            "triton",
            MAX_BATCH,
            MAX_BATCH * q,
            MAX_BATCH * W,
            dev,
            mode,
            num_draft_tokens=q,
            pad_page=0,
            max_seq_len=MAX_SEQ,
        )
        legacy = LegacyRefresh(gs)
        table = torch.randperm(MAX_BATCH * W + 1, generator=g)[1:].view(MAX_BATCH, W).to(torch.int32).to(dev)
        for bs in (1, 8, 64):
            gs.prepare_capture(bs)
            seq = torch.randint(1024, 16384, (bs,), generator=g).to(torch.int32).to(dev)
            seq[-1] = 0 if bs > 1 else seq[-1]  # one vLLM padding row
            legacy(seq, table[:bs], bs)
            want = snapshot(gs, bs)
            gs.update_from_block_table(seq, table[:bs], bs)
            got = snapshot(gs, bs)
            assert all(torch.equal(x, y) for x, y in zip(want, got)), f"{mode} bs={bs}: paths disagree"
            t_old = per_call_us(lambda: legacy(seq, table[:bs], bs))
            t_new = per_call_us(lambda: gs.update_from_block_table(seq, table[:bs], bs))
            rows.append(
                {
                    "mode": mode,
                    "q": q,
                    "batch": bs,
                    "torch_ops_us": round(t_old, 1),
                    "one_kernel_us": round(t_new, 1),
                    "saved_us_per_step": round(t_old - t_new, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "page_size": P,
        "max_batch": MAX_BATCH,
        "max_seq_len": MAX_SEQ,
        "rows": rows,
    }
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
