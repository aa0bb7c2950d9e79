"""Decode inside CUDA graphs as the engines replay it, per layer, bf16 against fp8 KV: each attnplug
provider's decode graph captured for a long ``max_seq_len`` (the engine's context length) and replayed
on short contexts, FlashInfer's own decode wrapper captured the same way with host-float scales (what
SGLang's flashinfer backend runs), and attnplug's KV write alone. A provider named ``PROVIDER+host``
gets the fp8 scales as host floats too (``host_scales``).

    python benchmarks/probes/decode_graph_bench.py --out DIR              # GPU: DIR/decode-graph.json
    python benchmarks/probes/decode_graph_bench.py --smoke --out DIR      # CPU (Triton interpreter), no timing

Why: in SGLang 0.5.17 on the H200, one request of 1024 tokens, every attnplug backend lost more per
decode step to fp8 than SGLang's flashinfer did (``benchmarks/history/2026-12-02.md``, "Eleventh session"); this
puts the per-layer pieces side by side in one call.

Each case holds ``--layers`` copies of the row's cache (a layer's KV is not in L2 when its turn comes,
as in a model) and one graph of ``--layers`` launches; reported: ms per layer (median replay time /
layers, CUDA events), the split count the graph's plan fixed at capture, and layer 0's relative error
against the float32 reference (fp8: on the dequantized cache). Llama-3-8B attention (32/8 heads, d 128).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cascade_graph_bench import timed_ms  # noqa: E402

from attnplug.bench.workloads import Row, Work, build, reference, rel_err  # noqa: E402
from attnplug.core import AttentionConfig  # noqa: E402
from attnplug.core.cuda_graph import GraphState  # noqa: E402
from attnplug.core.kernels.kv_write import write_kv_paged  # noqa: E402
from attnplug.core.page_table import slot_mapping  # noqa: E402
from attnplug.core.pages import num_pages  # noqa: E402
from attnplug.core.providers import ProviderUnavailable  # noqa: E402


def replay_ms(launch, layers: int, device: torch.device, reps: int = 100) -> float:
    """ms per layer: ``launch(i)`` for ``i < layers`` captured in one graph, median replay / layers
    (:func:`cascade_graph_bench.timed_ms`; CPU: the launches run once, uncaptured, and the time is NaN)."""
    if device.type != "cuda":
        for i in range(layers):
            launch(i)
        return float("nan")
    for i in range(layers):  # compile outside the capture
        launch(i)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            launch(i)
    return timed_ms(g.replay, reps) / layers


def caches(work: Work, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Layer 0's cache is the row's own; the others are copies."""
    return [(work.k_cache, work.v_cache)] + [(work.k_cache.clone(), work.v_cache.clone()) for _ in range(layers - 1)]


def attnplug_case(work: Work, kv: list, provider: str, capture_len: int, layers: int) -> dict:
    """The provider's decode ``GraphState`` captured for ``capture_len`` keys, updated with the row's batch.
    ``PROVIDER+host``: fp8 rows also pass the scales as host floats (``host_scales``, as the adapters do
    where the engine fixes them)."""
    cfg, q, B = work.config, work.q, work.row.batch
    from attnplug.bench.impls import engine_scales  # noqa: PLC0415

    provider, host = provider.removesuffix("+host"), provider.endswith("+host")
    sc = engine_scales(work) if host else work.extra.get("scales", {})
    try:
        gs = GraphState(
            cfg,
            provider,
            max_batch=B,
            max_tokens=B,
            max_pages=B * num_pages(capture_len, cfg.page_size),
            device=q.device,
            max_seq_len=capture_len,
        )
    except ProviderUnavailable as e:
        return {"unavailable": str(e)}
    gs.prepare_capture(B)
    plan = gs.update(work.batch, B)
    outs = [torch.empty_like(q) for _ in range(layers)]
    ms = replay_ms(lambda i: gs.run(B, q, kv[i][0], kv[i][1], outs[i], **sc), layers, q.device)
    st = plan.state
    return dict(
        ms_per_layer=ms,
        rel_err=rel_err(outs[0], reference(work, B)),
        **{
            k: getattr(st, a)
            for k, a in (
                ("splits", "num_splits"),
                ("kernel", "kernel"),
                ("block_n", "block_n"),
                ("fp8_f16", "fp8_f16"),
                ("pairs", "pairs"),
            )
            if hasattr(st, a)
        },
    )


def flashinfer_case(work: Work, kv: list, layers: int) -> dict:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` as the bench's ``flashinfer.decode_tc`` plans
    it (tensor cores; fp8: the fa2 template, scales as host floats), with ``use_cuda_graph=True`` on the
    row's own plan: the engines' native path."""
    from attnplug.bench.impls import Unavailable, _fi_common, _fi_scales, _flashinfer, _workspace  # noqa: PLC0415
    from attnplug.core.providers.flashinfer import fa2_decode_kwargs  # noqa: PLC0415

    try:
        fi = _flashinfer()
    except Unavailable as e:
        return {"unavailable": str(e)}
    cfg, b, q, dev = work.config, work.batch, work.q, work.q.device
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(dev),
        cfg.kv_layout,
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=b.kv_indptr.to(dev),
        paged_kv_indices_buffer=b.kv_indices.to(dev),
        paged_kv_last_page_len_buffer=b.kv_last_page_len.to(dev),
        **(fa2_decode_kwargs(fi) if work.row.kv == "fp8" else {}),
    )
    w.plan(
        b.kv_indptr,
        b.kv_indices,
        b.kv_last_page_len,
        cfg.num_qo_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.page_size,
        **_fi_common(work),
    )
    outs, sc = [torch.empty_like(q) for _ in range(layers)], _fi_scales(work)
    ms = replay_ms(lambda i: w.run(q, kv[i], out=outs[i], **sc), layers, dev)
    return dict(ms_per_layer=ms, rel_err=rel_err(outs[0], reference(work, work.row.batch)))


def kv_write_case(work: Work, kv: list, layers: int) -> dict:
    """attnplug's KV write of the step's ``B`` new tokens (one launch per layer), into each request's
    last slot (:func:`attnplug.core.page_table.slot_mapping`)."""
    cfg, B, dev = work.config, work.row.batch, work.q.device
    k_new = torch.randn(B, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=dev)
    slots = slot_mapping(work.block_table, work.seq_lens - 1, torch.arange(B, device=dev), cfg.page_size)
    sc = work.extra.get("scales", {})
    # the write overwrites the last key of every request: the attention cases above have already run
    return dict(
        ms_per_layer=replay_ms(lambda i: write_kv_paged(k_new, k_new, kv[i][0], kv[i][1], slots, **sc), layers, dev)
    )


def guarded(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": ...}`` when it raises: one failing case does not cost the call's other
    cases (the JSON and the printed line show the error)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny shapes, no timing")
    ap.add_argument("--providers", default="triton,fa3,flashinfer")
    ap.add_argument("--rows", default="1x1024,64x1024", help="comma list of BxKV (decode, one new token each)")
    ap.add_argument("--pages", default="1,16", help="page sizes (SGLang runs page 1)")
    ap.add_argument(
        "--capture-len",
        default="32768",
        help="max_seq_len the graphs are captured for; a comma list also captures each provider at the "
        "later lengths (cases 'PROVIDER@LEN': the split count chosen for that length)",
    )
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument(
        "--min-split-keys",
        type=int,
        default=None,
        help="the triton provider's split rule with this min_split_keys in every split decode entry "
        "(decode_split / decode_tiny) of the tile table, instead of the provider's default "
        "(TritonProvider.split_count)",
    )
    a = ap.parse_args()
    if a.min_split_keys is not None:
        from attnplug.core.kernels import tiles  # noqa: PLC0415

        for key in [k for k in tiles.TILES if "/decode_split" in k or "/decode_tiny" in k]:
            tiles.TILES[key] = dict(tiles.TILES[key], min_split_keys=a.min_split_keys)
    if a.smoke:
        dev, heads, rows, pages, caps, layers = torch.device("cpu"), (4, 2, 32), ["2x40"], [1, 16], [256, 64], 2
        providers = ["triton"]
    else:
        dev, heads, caps, layers = (
            torch.device("cuda"),
            (32, 8, 128),
            [int(c) for c in a.capture_len.split(",")],
            a.layers,
        )
        rows, pages, providers = a.rows.split(","), [int(p) for p in a.pages.split(",")], a.providers.split(",")
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "min_split_keys": a.min_split_keys,
        "capture_len": caps[0],
        "capture_lens": caps,
        "layers": layers,
        "cases": {},
    }
    for P in pages:
        cfg = AttentionConfig(*heads, P, torch.bfloat16)
        for r in rows:
            B, kv_len = (int(x) for x in r.split("x"))
            for kvt in ("", "fp8"):
                name = f"decode {r} page {P}" + (" fp8" if kvt else "")
                work = build(Row(name, "decode", B, 1, kv_len - 1, kv=kvt), cfg, dev)
                kv = caches(work, layers)
                case = {
                    p if c == caps[0] else f"{p}@{c}": guarded(attnplug_case, work, kv, p, c, layers)
                    for p in providers
                    for c in caps
                }
                if any(p.startswith("flashinfer") for p in providers):
                    case["flashinfer.native"] = guarded(flashinfer_case, work, kv, layers)
                case["attnplug.kv_write"] = guarded(kv_write_case, work, kv, layers)
                res["cases"][name] = case
                print(name, json.dumps(case), flush=True)
                del kv, work
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "decode-graph.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
