"""``python -m attnplug.bench``: attnplug providers next to FlashInfer / FA3 called directly and PyTorch.

    python -m attnplug.bench                       # GPU run: all rows, all providers
    python -m attnplug.bench --rows decode,verify --providers triton,flashinfer --out /tmp/r
    python -m attnplug.bench --quick               # CPU smoke run (Triton interpreter, tiny shapes)

Every implementation is checked against the float32 reference (first requests of the row) before it
is timed; a wrong one is reported and not timed. Unavailable libraries become ``unavailable: why``
records, listed in the markdown's footnote. Results (JSON; markdown, one table per row kind; a PNG
plot when matplotlib is installed, the [bench] extra, else a printed notice) are rewritten after every
row under ``--out`` (default ``./attnplug-bench`` in the current directory), named ``<gpu>-<date>``, so
a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import re
import sys
import time
import traceback

ERR_MAX = 5e-2  # above this an implementation is reported wrong and not timed


def not_timed_if_wrong(rec: dict) -> None:
    """A CUDA-graph replay whose output is wrong (``rec["err_graph"]``: e.g. a library wrapper that is not
    capturable) keeps no time: status WRONG, no ms / GB/s / TFLOP/s."""
    err = rec.get("err_graph")
    if err is not None and (not math.isfinite(err) or err > ERR_MAX):
        for k in ("ms", "GBps", "TFLOPs"):
            rec.pop(k, None)
        rec["status"] = f"WRONG: the CUDA-graph replay's rel err {err:.2e} > {ERR_MAX} vs float32 reference; not timed"


def ratios(recs: list[dict]) -> None:
    """``vs_best_lib`` (best timed library ms / this ms) and ``vs_own_lib`` (the same family's library
    kernel; fp8 acceptance: a provider >= 0.95x its library's kernel) of one row's records, in place."""
    best = min((r["ms"] for r in recs if r.get("library") and r.get("ms")), default=None)
    for r in recs:
        r["vs_best_lib"] = best / r["ms"] if best and r.get("ms") else None
        own = min(
            (x["ms"] for x in recs if x.get("library") and x.get("ms") and x["family"] == r.get("family")), default=None
        )
        r["vs_own_lib"] = own / r["ms"] if own and r.get("ms") and not r.get("library") else None


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m attnplug.bench",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run; Triton interpreter on CPU)")
    p.add_argument(
        "--providers",
        default="triton,flashinfer,fa3,torch",
        help="families to run: triton, flashinfer, fa3, torch (comma-separated)",
    )
    p.add_argument(
        "--rows",
        default="",
        help="row kinds (decode, prefill, verify), row-name substrings, or whole row names ending in '$'",
    )
    p.add_argument("--out", default="attnplug-bench", help="output folder (default: ./attnplug-bench)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--time-budget", type=float, default=0, help="seconds; later rows are skipped (0: none)")
    p.add_argument("--no-ceilings", action="store_true", help="skip the memory-bandwidth / matmul ceiling probes")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="time every implementation as a CUDA-graph replay (the kernels without host launch gaps, "
        "as the engines run decode); eager-only implementations run their capturable twin "
        "(FlashInfer: a use_cuda_graph wrapper or GraphState), others are reported n/a",
    )
    return p.parse_args(argv)


def _versions(fams) -> dict:
    import torch  # noqa: PLC0415

    env = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("triton", "flashinfer"):
        try:
            env[mod] = __import__(mod).__version__ if (mod != "flashinfer" or "flashinfer" in fams) else "not run"
        except Exception as e:
            env[mod] = f"unavailable ({type(e).__name__})"
    try:
        from ..core.providers.fa3 import load_fa3  # noqa: PLC0415

        env["fa3"] = load_fa3().source if "fa3" in fams else "not run"
    except Exception:
        env["fa3"] = "unavailable"
    return env


def main(argv=None) -> int:
    args = _parse(argv)
    import torch  # noqa: PLC0415

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ..core import AttentionConfig  # noqa: PLC0415
    from . import impls as I  # noqa: PLC0415
    from . import report, timing  # noqa: PLC0415
    from . import workloads as W

    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:  # progress as plain lines
        tqdm = None

    fams = [f.strip() for f in args.providers.split(",") if f.strip()]
    bad = [f for f in fams if f not in I.FAMILIES]
    if bad:
        print(f"unknown --providers {bad}; expected some of {I.FAMILIES}", file=sys.stderr)
        return 2
    from .mla import mla_rows, up_projected  # noqa: PLC0415

    cfg_kw, rows = (W.QUICK_CONFIG, W.QUICK_ROWS) if args.quick else (W.FULL_CONFIG, W.FULL_ROWS)
    rows = rows + mla_rows(args.quick)
    sel = [s.strip() for s in args.rows.split(",") if s.strip()]
    if sel:
        rows = [
            r for r in rows if any(s == r.kind or (s[:-1] == r.name if s.endswith("$") else s in r.name) for s in sel)
        ]
    config = AttentionConfig(**cfg_kw)
    impls = [i for i in I.IMPLS if i.family in fams]
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    date = datetime.date.today().isoformat()
    stem = (
        f"{re.sub(r'[^a-z0-9]+', '-', dev_name.lower()).strip('-')}-{date}"
        + ("-quick" if args.quick else "")
        + ("-graphs" if args.cuda_graphs and device.type == "cuda" else "")
    )
    env = {
        "device": dev_name,
        "date": date,
        **_versions(fams),
        "argv": sys.argv[1:],
        "timing": "cuda-graph replay" if args.cuda_graphs and device.type == "cuda" else "eager",
    }
    res = {
        "env": env,
        "ceilings": {},
        "rows": [],
        "shape": f"{config.num_qo_heads} q heads, {config.num_kv_heads} KV heads, head dim {config.head_dim}, "
        f"page {config.page_size}, {str(config.dtype).replace('torch.', '')}, random permuted page tables",
    }
    print(f"attnplug.bench: {dev_name}; rows {[r.name for r in rows]}; impls {[i.name for i in impls]}", flush=True)

    t_start = time.time()
    if not args.no_ceilings:
        try:
            res["ceilings"] = timing.ceilings(device, args.quick)
            print(f"ceilings: {res['ceilings']}", flush=True)
        except Exception as e:
            res["ceilings"] = {"error": repr(e)}
            print(f"ceilings failed: {e!r}", flush=True)

    bar = tqdm(total=len(rows) * len(impls), unit="run", dynamic_ncols=True) if tqdm else None
    say = bar.write if bar else (lambda s: print(s, flush=True))
    for row in rows:
        base = dict(row=row.name, kind=row.kind, metric=row.metric)
        if args.time_budget and time.time() - t_start > args.time_budget:
            for impl in impls:
                res["rows"].append({**base, "impl": impl.name, "status": "skipped: time budget"})
            bar and bar.update(len(impls))
            continue
        try:
            work = W.build(row, config, device, seed=len(res["rows"]))
            nb = W.ref_requests(row)
            _, t_ref = W.sub_plan(work, nb)
            ref = W.reference(work, nb)
        except Exception as e:
            say(f"[{row.name}] setup failed: {e!r}\n{traceback.format_exc()}")
            for impl in impls:
                res["rows"].append({**base, "impl": impl.name, "status": f"error: setup: {e!r}"})
            bar and bar.update(len(impls))
            continue
        recs = []
        for impl in impls:
            rec = {**base, "impl": impl.name, "family": impl.family, "library": impl.is_library}
            if bar:
                bar.set_description(f"{row.name} | {impl.name}")
            fn = None
            try:
                fn = impl.make(work)
                o = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                # MLA's un-absorbed prefill returns the up-projected output: against the reference times W_UV
                err = W.rel_err(o[:t_ref], ref if o.shape[-1] == ref.shape[-1] else up_projected(work, ref))
                rec["err"] = err
                if f"{impl.name}.plan_ms" in work.extra:
                    rec["plan_ms"] = work.extra[f"{impl.name}.plan_ms"]
                if f"{impl.name}.cascade" in work.extra:
                    rec["cascade"] = work.extra[f"{impl.name}.cascade"]
                if not math.isfinite(err) or err > ERR_MAX:
                    rec["status"] = f"WRONG: rel err {err:.2e} > {ERR_MAX} vs float32 reference; not timed"
                else:
                    if args.cuda_graphs:
                        fn = timing.graphed(fn, device)
                    ms = timing.bench_ms(fn, device)
                    rec.update(ms=ms, GBps=work.nbytes / ms / 1e6, TFLOPs=work.flops / ms / 1e9, status="ok")
                    if args.cuda_graphs:  # the replayed graph's own output, after the timing loop, into NaN
                        fn().fill_(math.nan)
                        o = fn()
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        rec["err_graph"] = W.rel_err(
                            o[:t_ref], ref if o.shape[-1] == ref.shape[-1] else up_projected(work, ref)
                        )
                        not_timed_if_wrong(rec)
            except I.Unavailable as e:
                rec["status"] = f"unavailable: {e}"
            except I.NotApplicable as e:
                rec["status"] = f"n/a: {e}"
            except timing.NotCapturable as e:
                rec["status"] = f"n/a: --cuda-graphs: not capturable: {e}"
            except Exception as e:
                rec["status"] = f"error: {type(e).__name__}: {e}"
                say(f"[{row.name} | {impl.name}] {traceback.format_exc()}")
            finally:
                fn = None
            recs.append(rec)
            if rec.get("ms"):
                fig = f"{rec['TFLOPs']:.1f} TFLOP/s" if row.kind == "prefill" else f"{rec['GBps']:.0f} GB/s"
                say(f"{row.name:26s} {impl.name:24s} {rec['ms']:9.4f} ms  {fig:>14s}  err {rec['err']:.1e}")
            else:
                say(f"{row.name:26s} {impl.name:24s} {rec['status'][:140]}")
            bar and bar.update(1)
        ratios(recs)
        res["rows"].extend(recs)
        del work, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.write(res, args.out, stem, png=False)
    bar and bar.close()
    res["wall_s"] = time.time() - t_start
    paths = report.write(res, args.out, stem, png=True)
    print(report.summary(res))
    print("wrote " + ", ".join(paths), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
