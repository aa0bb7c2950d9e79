"""Demo: SGLang serving the tiny Llama with ``--attention-backend attnplug_triton``.

    python -m attnplug.tools.demo_sglang [--page-size 16] [--max-new-tokens 16] [--model-dir DIR]

Run it in an environment with SGLang and attnplug installed. Makes the tiny model (in a new
temporary folder unless --model-dir), launches ``python -m sglang.launch_server ...
--attention-backend attnplug_triton`` on 127.0.0.1, sends ``/generate`` with token ids, prints the
output ids, then does the same with SGLang's ``torch_native`` backend and ends with one line,
``PASS sglang: ...`` or ``FAIL sglang: ...``, quoting attnplug's active log line (exit 1 if the
outputs differ, the line is missing or a server does not start).

On a machine without CUDA it runs SGLang's CPU engine (``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1``).
SGLang then imports ``sgl_kernel``, whose wheel is CUDA-only: without an installed one, give a
stand-in with ``--sgl-kernel-shim DIR`` (or ``ATTNPLUG_SGL_KERNEL_SHIM``), e.g. the test-only shim of
attnplug's source tree, ``tests/sglang/sgl_kernel_shim`` (found by itself when run from a checkout).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from attnplug.tools.local_server import (
    active_line,
    error_line,
    free_port,
    post_json,
    stop_process_group,
    verdict,
    wait_healthy,
)

ACTIVE_LINE = "attnplug: attnplug_triton active"

WAVES = [[0, 1, 3, 4], [2]]  # prompt 2 shares a 96-token prefix with prompt 1: it runs second, from the cache


def _server_env(cpu: bool, shim: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if importlib.util.find_spec("sgl_kernel") is None:
            checkout = Path(__file__).resolve().parents[2] / "tests" / "sglang" / "sgl_kernel_shim"
            shim = Path(shim) if shim else checkout if checkout.is_dir() else None
            if shim is None or not (shim / "sgl_kernel").is_dir():
                sys.exit(
                    "FAIL sglang: SGLang's CPU engine imports sgl_kernel, whose wheel is CUDA-only, and none is "
                    "installed here: pass --sgl-kernel-shim DIR (a folder holding a sgl_kernel package, e.g. "
                    "tests/sglang/sgl_kernel_shim of attnplug's source tree)"
                )
            print(f"demo_sglang: using the CPU sgl_kernel stand-in {shim}")
            env["PYTHONPATH"] = os.pathsep.join([str(shim)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class ServerFailed(RuntimeError):
    """A server did not start or did not answer: ``str()`` is one line, ``log`` its log file."""

    def __init__(self, msg: str, log: str):
        super().__init__(msg)
        self.log = log


def serve_and_generate(model: Path, backend: str, prompts: list[list[int]], args, cpu: bool) -> tuple[list, list, str]:
    """Launch one server, generate greedily for ``prompts`` (in WAVES), stop it.

    Returns ``(output_ids per prompt, cached_tokens per prompt, the server log's text)``.

    Raises:
        ServerFailed: the server did not start or did not answer.
    """
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--skip-tokenizer-init",
        "--attention-backend",
        backend,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--page-size",
        str(args.page_size),
        "--disable-overlap-schedule",
        "--mem-fraction-static",
        "0.3",
        "--max-total-tokens",
        "4096",
        "--random-seed",
        "0",
        "--dtype",
        "float32",
    ]
    if cpu:
        cmd += ["--device", "cpu"]
    else:
        cmd += ["--disable-cuda-graph"]  # the demo compares eager runs
    log = tempfile.NamedTemporaryFile("w+", prefix=f"demo_sglang_{backend}_", suffix=".log", delete=False)
    env = _server_env(cpu, args.sgl_kernel_shim)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", log.name, args.timeout)
        except RuntimeError:
            raise ServerFailed(
                f"the {backend} server did not start: {error_line(Path(log.name).read_text(errors='replace'))}",
                log.name,
            ) from None
        sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
        got = {}
        try:
            for wave in WAVES:
                payload = {"input_ids": [prompts[i] for i in wave], "sampling_params": sp}
                got.update(zip(wave, post_json(f"http://127.0.0.1:{port}/generate", payload, timeout=600)))
        except OSError as e:
            raise ServerFailed(
                f"the {backend} server did not answer ({e}): {error_line(Path(log.name).read_text(errors='replace'))}",
                log.name,
            ) from None
    finally:
        stop_process_group(proc)  # the server's own process group
    ids = [got[i]["output_ids"] for i in range(len(prompts))]
    cached = [got[i]["meta_info"].get("cached_tokens", 0) for i in range(len(prompts))]
    return ids, cached, Path(log.name).read_text(errors="replace")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m attnplug.tools.demo_sglang",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--page-size", type=int, default=1, help="SGLang --page-size (default: 1)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per prompt (default: 16)")
    ap.add_argument(
        "--model-dir", type=Path, default=None, help="where the tiny model is written (default: a new temporary folder)"
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for each server (default: 300)")
    ap.add_argument(
        "--sgl-kernel-shim",
        default=os.environ.get("ATTNPLUG_SGL_KERNEL_SHIM"),
        help="CPU only, when no sgl_kernel is installed: a folder holding a stand-in sgl_kernel package",
    )
    args = ap.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = Path(tempfile.mkdtemp(prefix="attnplug-demo-sglang-"))

    import torch

    from attnplug.tools.tiny_model import make_tiny_llama, test_prompts

    cpu = not torch.cuda.is_available()
    model = make_tiny_llama(args.model_dir)
    prompts = test_prompts()
    print(
        f"demo_sglang: model {model}, device {'cpu' if cpu else 'cuda'}, page size {args.page_size}, "
        f"{len(prompts)} prompts (lengths {[len(p) for p in prompts]}), {args.max_new_tokens} new tokens each",
        flush=True,
    )
    try:
        print("demo_sglang: sglang.launch_server --attention-backend attnplug_triton ...", flush=True)
        ours, cached, log = serve_and_generate(model, "attnplug_triton", prompts, args, cpu)
        for i, o in enumerate(ours):
            print(f"  attnplug_triton prompt {i}: {o}  (cached prompt tokens: {cached[i]})")
        print("demo_sglang: sglang.launch_server --attention-backend torch_native ...", flush=True)
        ref, _, _ = serve_and_generate(model, "torch_native", prompts, args, cpu)
    except ServerFailed as e:
        print(f"FAIL sglang: {e} (log: {e.log})", flush=True)
        return 1
    same = [a == b for a, b in zip(ours, ref)]
    for i, (o, s) in enumerate(zip(ref, same)):
        print(f"  torch_native    prompt {i}: {o}  {'==' if s else '!= MISMATCH'}")
    detail = (
        f"attnplug_triton {'matches' if all(same) else 'DOES NOT match'} torch_native "
        f"({sum(same)}/{len(same)} prompts identical)"
    )
    return verdict("sglang", all(same), detail, active_line(log, ACTIVE_LINE))


if __name__ == "__main__":
    sys.exit(main())
