"""How the prefill loop's K/V loads cost at page 16 (issue 14): one non-causal attention loop, four ways of
loading a 64-key block, same grid and tiles, timed on the GPU (the sm90 SASS of each: ``--sass DIR`` on CPU).

    python benchmarks/probes/prefill_page_loads_probe.py [--out F.json]     # GPU
    python benchmarks/probes/prefill_page_loads_probe.py --sass DIR         # CPU: compile for sm90, count instructions

Modes (``[BLOCK_M, D]`` GQA-packed query tiles, 4096 keys a program through a random page table, 32/8 heads,
d 128, bf16; the online-softmax step of a 64-key block is the prefill kernel's own ``softmax_update``):

  gather       per-key pointer loads through the page table (what ``kernels/prefill.py`` does at page 16)
  pieces       page 16 through tensor descriptors: four ``[16, D]`` TMA loads a block, ``Q K^T`` per page (n16
               wgmmas), one online-softmax step over the four pages, ``P V`` per page (k16 wgmmas)
  pieces_qreg  the same with the query scaled in registers (Triton then feeds the n16 wgmmas from registers)
  page64       page 64 through descriptors: one ``[64, D]`` TMA load a block (the bound: no gather)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
import triton.language as tl

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, REPO)

from attnplug.core.kernels.prefill import softmax_update  # noqa: E402

MODES = ("gather", "pieces", "pieces_qreg", "page64")


@triton.jit
def _loop_kernel(
    Q,
    O,
    K,
    V,
    K_desc,
    V_desc,
    kv_indices,
    n_keys,
    stride_kp,
    stride_kt,
    stride_kh,
    scale,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    MODE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    tile, kvh, n_tiles = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    base = ((kvh * n_tiles + tile) * BLOCK_M).to(tl.int64) * D
    q = tl.load(Q + base + rows[:, None] * D + d[None, :])
    qk_scale = scale * 1.4426950408889634
    if MODE == 2:  # scaled in registers: the n16 wgmmas read q from registers
        q = (q.to(tl.float32) * qk_scale).to(tl.bfloat16)
        qk_scale = 1.0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in tl.range(0, n_keys, 64, num_stages=NUM_STAGES):
        if MODE == 0:
            n = n0 + tl.arange(0, 64)
            off = tl.load(kv_indices + n // PAGE).to(tl.int64) * stride_kp + (n % PAGE) * stride_kt + kvh * stride_kh
            s = tl.dot(q, tl.load(K + off[None, :] + d[:, None]))
            m_new, l_i, p, alpha = softmax_update(s, n0, 0, 0, m_i, l_i, qk_scale, 0.0, 64, False, False, False)
            acc = tl.dot(p.to(tl.bfloat16), tl.load(V + off[:, None] + d[None, :]), acc * alpha[:, None])
        elif MODE == 3:
            pg = tl.load(kv_indices + n0 // PAGE)
            s = tl.dot(q, K_desc.load([pg, n0 % PAGE, kvh, 0]).reshape(64, D).T)
            m_new, l_i, p, alpha = softmax_update(s, n0, 0, 0, m_i, l_i, qk_scale, 0.0, 64, False, False, False)
            v = V_desc.load([pg, n0 % PAGE, kvh, 0]).reshape(64, D)
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        else:
            i0 = tl.load(kv_indices + n0 // PAGE)
            i1 = tl.load(kv_indices + n0 // PAGE + 1)
            i2 = tl.load(kv_indices + n0 // PAGE + 2)
            i3 = tl.load(kv_indices + n0 // PAGE + 3)
            s0 = tl.dot(q, K_desc.load([i0, 0, kvh, 0]).reshape(PAGE, D).T)
            s1 = tl.dot(q, K_desc.load([i1, 0, kvh, 0]).reshape(PAGE, D).T)
            s2 = tl.dot(q, K_desc.load([i2, 0, kvh, 0]).reshape(PAGE, D).T)
            s3 = tl.dot(q, K_desc.load([i3, 0, kvh, 0]).reshape(PAGE, D).T)
            mx = tl.maximum(tl.maximum(tl.max(s0, 1), tl.max(s1, 1)), tl.maximum(tl.max(s2, 1), tl.max(s3, 1)))
            m_new = tl.maximum(m_i, mx * qk_scale)
            alpha = tl.exp2(m_i - m_new)
            p0 = tl.exp2(s0 * qk_scale - m_new[:, None])
            p1 = tl.exp2(s1 * qk_scale - m_new[:, None])
            p2 = tl.exp2(s2 * qk_scale - m_new[:, None])
            p3 = tl.exp2(s3 * qk_scale - m_new[:, None])
            l_i = l_i * alpha + (tl.sum(p0, 1) + tl.sum(p1, 1)) + (tl.sum(p2, 1) + tl.sum(p3, 1))
            acc = acc * alpha[:, None]
            acc = tl.dot(p0.to(tl.bfloat16), V_desc.load([i0, 0, kvh, 0]).reshape(PAGE, D), acc)
            acc = tl.dot(p1.to(tl.bfloat16), V_desc.load([i1, 0, kvh, 0]).reshape(PAGE, D), acc)
            acc = tl.dot(p2.to(tl.bfloat16), V_desc.load([i2, 0, kvh, 0]).reshape(PAGE, D), acc)
            acc = tl.dot(p3.to(tl.bfloat16), V_desc.load([i3, 0, kvh, 0]).reshape(PAGE, D), acc)
        m_i = m_new
    tl.store(O + base + rows[:, None] * D + d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


def case(mode: str, device, n_keys=4096, tiles=32, hkv=8, block_m=128, d=128, seed=0):
    """Inputs of one mode: Q/O ``[Hkv, tiles, BLOCK_M, D]``, K/V caches ``[pages, PAGE, Hkv, D]`` (page 64 for
    ``page64``, else 16), a random page table of ``n_keys`` keys, the descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    page = 64 if mode == "page64" else 16
    g = torch.Generator().manual_seed(seed)
    pages = n_keys // page
    num_pages = pages + 7
    q = torch.randn(hkv, tiles, block_m, d, generator=g).to(torch.bfloat16).to(device)
    k = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16).to(device)
    idx = torch.randperm(num_pages, generator=g)[:pages].to(torch.int32).to(device)
    box = [1, 64 if page == 64 else 16, 1, d]
    kd = TensorDescriptor(k, list(k.shape), list(k.stride()), box)
    vd = TensorDescriptor(v, list(v.shape), list(v.stride()), box)
    return dict(
        q=q, k=k, v=v, idx=idx, kd=kd, vd=vd, page=page, n_keys=n_keys, tiles=tiles, hkv=hkv, block_m=block_m, d=d
    )


def launch(c, mode, out, stages, warps, launcher=None):
    kern = launcher or _loop_kernel
    kern[(c["tiles"], c["hkv"])](
        c["q"],
        out,
        c["k"],
        c["v"],
        c["kd"],
        c["vd"],
        c["idx"],
        c["n_keys"],
        *c["k"].stride()[:3],
        c["d"] ** -0.5,
        BLOCK_M=c["block_m"],
        D=c["d"],
        PAGE=c["page"],
        MODE=MODES.index(mode),
        NUM_STAGES=stages,
        num_warps=warps,
        num_stages=stages,
    )


def reference(c):
    """float32 attention of each tile's rows over the page table's keys ``[Hkv, tiles, BLOCK_M, D]``."""
    kk = c["k"].float()[c["idx"].long()].reshape(-1, c["hkv"], c["d"])  # [n_keys, Hkv, D]
    vv = c["v"].float()[c["idx"].long()].reshape(-1, c["hkv"], c["d"])
    s = torch.einsum("htmd,nhd->htmn", c["q"].float(), kk) * c["d"] ** -0.5
    return torch.einsum("htmn,nhd->htmd", s.softmax(-1), vv)


def sass_stats(out_dir):
    """CPU: compile every mode for sm90 (Triton's NVIDIA pipeline, ptxas) and count the loop's instructions."""
    sys.path.insert(0, os.path.join(REPO, "tests", "core"))
    import sm90_aot as aot
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.makedirs(out_dir, exist_ok=True)
    for mode in MODES:
        c = case(mode, "cpu", tiles=1, hkv=1)
        rec = {}

        class Rec:
            def __getitem__(self, grid):
                return lambda *a, **kw: rec.update(a=a, kw=kw)

        launch(c, mode, torch.empty_like(c["q"]), 3, 8, Rec())
        sig, const, opts, attrs = aot.signature(_loop_kernel, rec["a"], rec["kw"])
        k = triton.compile(
            ASTSource(fn=_loop_kernel, signature=sig, constexprs=const, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=opts,
        )
        sass = aot.cuobjdump(k.asm["cubin"], "-sass")
        open(os.path.join(out_dir, f"{mode}.sass"), "w").write(sass)
        ops = {}
        for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass):
            op = m.group(1)
            key = op if op.startswith(("HGMMA", "UTMALDG", "BAR", "LDGSTS", "LDSM")) else op.split(".")[0]
            ops[key] = ops.get(key, 0) + 1
        keep = {
            x: ops.get(x, 0) for x in ops if x.startswith(("HGMMA", "UTMALDG", "BAR", "LDGSTS", "LDSM", "MUFU", "IMAD"))
        }
        print(f"{mode:12s} {aot.resource_usage(k.asm['cubin'])} smem {k.metadata.shared} {keep}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sass", default=None, help="CPU: compile for sm90 into this directory and count instructions")
    a = ap.parse_args()
    if a.sass:
        return sass_stats(a.sass)
    from triton.testing import do_bench

    dev = torch.device("cuda")
    res = []
    for mode in MODES:
        c = case(mode, dev)
        ref = reference(c)
        flop = 4 * c["hkv"] * c["tiles"] * c["block_m"] * c["n_keys"] * c["d"]
        for stages in (2, 3, 4):
            out = torch.full_like(c["q"], float("nan"))
            try:
                launch(c, mode, out, stages, 8)
                err = float((out.float() - ref).norm() / ref.norm())
                ms = do_bench(lambda: launch(c, mode, out, stages, 8), warmup=25, rep=200)
                r = dict(mode=mode, stages=stages, ms=ms, tflops=flop / ms / 1e9, err=err)
            except Exception as e:  # e.g. out of shared memory at 4 stages
                r = dict(mode=mode, stages=stages, error=f"{type(e).__name__}: {str(e)[:160]}")
            res.append(r)
            print("probe:", json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
