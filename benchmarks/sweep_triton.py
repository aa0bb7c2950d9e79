"""Block-size sweep of the triton provider on Llama-3-8B attention shapes (run on the GPU).

    bash scripts/gpu_run.sh python3 benchmarks/sweep_triton.py > sweep.jsonl
Prints one JSON line per (row, config): median ms via triton.testing.do_bench.
"""
import itertools, json, math
import torch, triton.testing as tt
from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention

dev, HQ, HKV, D, P = "cuda", 32, 8, 128, 16
cfg = AttentionConfig(HQ, HKV, D, P, torch.bfloat16)


def make(bs, ctx, qlen, mode):
    pages_per = math.ceil(ctx / P)
    npages = bs * pages_per
    k = torch.randn(npages, P, HKV, D, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    perm = torch.randperm(npages).int()
    kv_indptr = torch.arange(0, bs + 1, dtype=torch.int32) * pages_per
    last = torch.full((bs,), (ctx - 1) % P + 1, dtype=torch.int32)
    qo = torch.arange(0, bs + 1, dtype=torch.int32) * qlen
    q = torch.randn(bs * qlen, HQ, D, dtype=torch.bfloat16, device=dev)
    mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        m = torch.ones(bs, qlen, ctx, dtype=torch.bool)
        m[:, :, ctx - qlen:] = torch.tril(torch.ones(qlen, qlen, dtype=torch.bool))
        mask = m.flatten()
    return BatchMetadata(mode, qo, kv_indptr, perm, last, custom_mask=mask), q, k, v, npages


big = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
       for bm, bn, w, st in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])]
dec = [dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in itertools.product([32, 64, 128], [2, 4, 8], [2, 3])]
rows = [
    ("prefill", 4, 4096, 4096, ForwardMode.EXTEND, big),
    ("extend", 8, 4608, 512, ForwardMode.EXTEND, big),
    ("verify", 32, 4160, 64, ForwardMode.TARGET_VERIFY, [dict(c) for c in big] + [dict(block_m=256, block_n=64, num_warps=8, num_stages=2)]),
    ("decode", 16, 16384, 1, ForwardMode.DECODE, dec),
    ("decode", 128, 2048, 1, ForwardMode.DECODE, dec),
    ("decode", 1, 32768, 1, ForwardMode.DECODE, [dict(c, num_kv_splits=s) for c in dec[:: 3] for s in (16, 32, 64)]),
]
for name, bs, ctx, ql, mode, cfgs in rows:
    batch, q, k, v, npages = make(bs, ctx, ql, mode)
    out = torch.empty_like(q)
    a = PagedAttention(cfg, "triton", dev)
    a.plan(batch, num_pages=npages)
    a.run(q, k, v, out=out)
    ref = out.clone()
    base = tt.do_bench(lambda: a.run(q, k, v, out=out), warmup=10, rep=50, return_mode="median")
    print(json.dumps(dict(row=name, bs=bs, ctx=ctx, qlen=ql, cfg="default", ms=base)), flush=True)
    for c in cfgs:
        try:
            a.plan(batch, num_pages=npages, **c)
            a.run(q, k, v, out=out)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            ms = tt.do_bench(lambda: a.run(q, k, v, out=out), warmup=10, rep=50, return_mode="median")
            print(json.dumps(dict(row=name, bs=bs, ctx=ctx, qlen=ql, cfg=c, ms=ms, err_vs_default=err)), flush=True)
        except Exception as e:
            print(json.dumps(dict(row=name, cfg=c, error=repr(e)[:200])), flush=True)
