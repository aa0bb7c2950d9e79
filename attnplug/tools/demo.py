"""``python -m attnplug.tools.demo``: plan one ragged paged batch per mode and run it through every
provider available here, printing each one's error against the float32 reference.

On a machine without CUDA the triton provider runs under the Triton interpreter on CPU tensors;
flashinfer and fa3 are listed with the reason they are unavailable.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attnplug.tools.demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Engine-free demo: plan one ragged paged batch per mode (extend, decode, tree verify, and a\n"
        "decode whose requests share a prefix, read once by cascade attention) and\n"
        "run it through every attnplug provider available here (triton, flashinfer, fa3, reference),\n"
        "printing each one's relative error against the float32 reference. Writes nothing.\n\n"
        "On a machine without CUDA the triton provider runs under the Triton interpreter on CPU\n"
        "tensors (needs triton >= 3.7); flashinfer and fa3 print why they are unavailable.",
        epilog="exit status: 0 if every provider that ran is within bf16 tolerance (1e-2), else 1",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the batch and its data (default: 0)")
    args = p.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from ..core import PROVIDER_NAMES, AttentionConfig, BatchMetadata, ForwardMode, PagedAttention
    from ..core.reference import reference_attention

    gen = torch.Generator().manual_seed(args.seed)
    cfg = AttentionConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)
    prefix, new = [0, 37, 100, 16], [19, 5, 1, 8]  # ragged: empty prefix, mid-page prefix, ...
    kv = [a + b for a, b in zip(prefix, new)]
    n_pages = [-(-x // cfg.page_size) for x in kv]
    num_pages = sum(n_pages) + 5
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)  # random page table
    k_cache = torch.randn(cfg.kv_cache_shape(num_pages), generator=gen).to(cfg.dtype).to(device)
    v_cache = torch.randn(cfg.kv_cache_shape(num_pages), generator=gen).to(cfg.dtype).to(device)

    def batch(mode: ForwardMode, q_lens: list[int]) -> BatchMetadata:
        lens = [a + b for a, b in zip(prefix, q_lens)]
        pages = [-(-x // cfg.page_size) for x in lens]
        mask = None
        if mode == ForwardMode.TARGET_VERIFY:  # chain-shaped tree over the draft tokens
            mask = torch.cat(
                [
                    torch.cat(
                        [torch.ones(q, L - q, dtype=torch.bool), torch.ones(q, q, dtype=torch.bool).tril()], 1
                    ).flatten()
                    for q, L in zip(q_lens, lens)
                ]
            )
        return BatchMetadata(
            mode,
            qo_indptr=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
            kv_indptr=torch.tensor([0] + pages).cumsum(0).to(torch.int32),
            kv_indices=perm[: sum(pages)].clone(),
            kv_last_page_len=torch.tensor([(x - 1) % cfg.page_size + 1 for x in lens], dtype=torch.int32),
            custom_mask=mask,
        )

    batches = {
        "extend": batch(ForwardMode.EXTEND, new),
        "decode": batch(ForwardMode.DECODE, [1] * 4),
        "verify": batch(ForwardMode.TARGET_VERIFY, [4, 4, 4, 4]),
    }
    print(f"attnplug demo on {device}: {cfg}")
    worst = 0.0
    for name in PROVIDER_NAMES:
        try:
            attn = PagedAttention(cfg, name, device)
        except Exception as e:  # unavailable here, or refuses this config
            print(f"  {name:10s} unavailable: {e}")
            continue
        for mode_name, b in batches.items():
            try:
                plan = attn.plan(b, num_pages=num_pages)
            except Exception as e:
                print(f"  {name:10s} {mode_name:7s} refused: {e}")
                continue
            q = torch.randn(plan.num_tokens, cfg.num_qo_heads, cfg.head_dim, generator=gen).to(cfg.dtype).to(device)
            out = attn.run(q, k_cache, v_cache)
            ref, _ = reference_attention(plan, q, k_cache, v_cache)
            err = float((out.float() - ref).norm() / ref.norm())
            worst = max(worst, err if err == err else float("inf"))
            print(f"  {name:10s} {mode_name:7s} tokens={plan.num_tokens:3d} rel_err={err:.2e}")
    # shared prefixes: four requests whose prompts start with the same 64 tokens, placed by the core's
    # prefix-caching KV manager (same page ids), decoded with cascade attention (the prefix read once)
    from ..bench.shared_prefix import prompts, shared_prefix_batch

    sb, sq, sk, sv, sn = shared_prefix_batch(
        cfg, ForwardMode.DECODE, prompts([(4, 64)], 10, seed=args.seed), seed=args.seed, device=device
    )
    for name in PROVIDER_NAMES:
        try:
            attn = PagedAttention(cfg, name, device, cascade="always")
            plan = attn.plan(sb, num_pages=sn)
        except Exception as e:
            print(f"  {name:10s} cascade unavailable: {e}")
            continue
        out = attn.run(sq, sk, sv)
        ref, _ = reference_attention(plan, sq, sk, sv)
        err = float((out.float() - ref).norm() / ref.norm())
        worst = max(worst, err if err == err else float("inf"))
        groups = [(g.members.tolist(), g.pages * cfg.page_size) for g in plan.cascade.groups]
        print(f"  {name:10s} cascade decode (requests, shared tokens) {groups} rel_err={err:.2e}")
    ok = worst <= 1e-2
    print(f"worst relative error {worst:.2e}: {'OK' if ok else 'FAIL'} (bf16 tolerance 1e-2)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
