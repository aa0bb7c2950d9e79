"""Real servers under load (issue 17 §5): concurrent clients and faults against a running ``vllm serve``
or ``sglang.launch_server`` on 127.0.0.1. Stdlib only (runs in either engine's environment).

    python -m attnplug.bench.server_load --engine vllm --backend attnplug_triton \
        --out benchmarks/results/server-load-vllm.json

Starts the server (tiny random Llama, ``--skip-tokenizer-init``), then, all bounded in count and time:

1. ``baseline``: every request sent alone, one after the other (non-streaming) - the reference;
2. ``concurrent``: 32 clients at once, half streaming, half not; every answer must equal its baseline;
3. faults, each while 8 other clients run (their answers must equal the baseline) and each followed by a
   check that the server still answers correctly:
   ``disconnect`` (a streaming client reads two events and closes its socket), ``overlong`` (a prompt
   longer than the context: HTTP 400 expected), ``malformed`` (a body that is not JSON; a prompt that
   is not token ids; a negative ``max_tokens``: HTTP 4xx expected);
4. ``concurrent_after``: the 32 clients again, all answers equal to the baseline;
5. with ``--oov-probe`` (not part of the pass): token ids outside the vocabulary, then whether the server
   still answers - an engine property (the embedding runs before any attention backend), recorded for
   the native backend and attnplug alike.

Only loopback traffic; the server's process group is stopped at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..tools.local_server import free_port, stop_process_group, wait_healthy

MAX_TOKENS = 6
CONTEXT = 512


def requests(n: int = 32, seed: int = 5) -> list[list[int]]:
    """``n`` prompts of 5..40 token ids (BOS first); every fourth shares a 24-token prefix with the previous."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append(out[-1][:24] + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 10))])
        else:
            out.append([1] + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))])
    return out


class Client:
    """One engine's HTTP API: greedy generation of token ids, streaming or not."""

    def __init__(self, engine: str, port: int, timeout: float = 600):
        self.engine, self.port, self.timeout = engine, port, timeout

    def body(self, ids, max_tokens: int = MAX_TOKENS, stream: bool = False) -> dict:
        if self.engine == "vllm":
            return dict(
                model="tiny",
                prompt=ids,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                return_token_ids=True,
                stream=stream,
            )
        return {
            "input_ids": ids,
            "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
        }

    @property
    def path(self) -> str:
        return "/v1/completions" if self.engine == "vllm" else "/generate"

    def raw(self, payload: bytes, stream_events: int | None = None) -> tuple[int, bytes]:
        """POST ``payload``; returns ``(status, body)``. ``stream_events``: read that many SSE events,
        then drop the connection (a client that goes away mid-stream)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("POST", self.path, body=payload, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if stream_events is None:
                return r.status, r.read()
            got = b""
            while got.count(b"data:") < stream_events:
                line = r.fp.readline()
                if not line:
                    break
                got += line
            conn.sock.shutdown(2)  # the client disappears
            return r.status, got
        finally:
            conn.close()

    def generate(self, ids, max_tokens: int = MAX_TOKENS, stream: bool = False) -> list[int]:
        status, data = self.raw(json.dumps(self.body(ids, max_tokens, stream)).encode())
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:500]!r}")
        if not stream:
            j = json.loads(data)
            return j["choices"][0]["token_ids"] if self.engine == "vllm" else j["output_ids"]
        events = [json.loads(x[5:]) for x in data.split(b"\n") if x.startswith(b"data:") and x[5:].strip() != b"[DONE]"]
        if self.engine == "vllm":
            return [t for e in events for c in e.get("choices", []) for t in (c.get("token_ids") or [])]
        seqs = [e["output_ids"] for e in events if "output_ids" in e]
        cumulative = all(b[: len(a)] == a for a, b in zip(seqs, seqs[1:]))
        return seqs[-1] if cumulative and seqs else [t for s in seqs for t in s]


def run_concurrently(jobs: list, n_threads: int | None = None) -> list:
    """Run ``jobs`` (callables) in threads at once; returns results (an exception object where one raised)."""
    out: list = [None] * len(jobs)

    def work(i):
        try:
            out[i] = jobs[i]()
        except Exception as e:  # noqa: BLE001 - recorded
            out[i] = e

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def check_round(client: Client, prompts, baseline, stream_mask) -> dict:
    t0 = time.time()
    res = run_concurrently(
        [lambda i=i: client.generate(prompts[i], stream=stream_mask[i]) for i in range(len(prompts))]
    )
    bad = {i: (repr(r)[:300] if isinstance(r, Exception) else r) for i, r in enumerate(res) if r != baseline[i]}
    return {
        "clients": len(prompts),
        "streaming": sum(stream_mask),
        "equal": len(prompts) - len(bad),
        "differ": bad,
        "seconds": round(time.time() - t0, 1),
    }


def fault_round(client: Client, name: str, fault, prompts, baseline) -> dict:
    """``fault`` (returns a dict) alongside 8 regular clients, then a health + correctness check."""
    t0 = time.time()
    others = list(range(min(8, len(prompts) - 2)))
    res = run_concurrently([fault] + [lambda i=i: client.generate(prompts[i], stream=bool(i % 2)) for i in others])
    f = res[0] if not isinstance(res[0], Exception) else {"exception": repr(res[0])[:400]}
    lost = {i: repr(r)[:300] if isinstance(r, Exception) else r for i, r in zip(others, res[1:]) if r != baseline[i]}
    after = client.generate(prompts[-1])
    return {
        "fault": name,
        **f,
        "others_equal": len(others) - len(lost),
        "others_differ": lost,
        "serving_after": after == baseline[-1],
        "seconds": round(time.time() - t0, 1),
    }


def load_test(client: Client, n_clients: int = 32) -> dict:
    prompts = requests(n_clients)
    t0 = time.time()
    baseline = [client.generate(p) for p in prompts]
    out = {"baseline": {"requests": len(prompts), "seconds": round(time.time() - t0, 1)}}
    half = [bool(i % 2) for i in range(n_clients)]
    out["concurrent"] = check_round(client, prompts, baseline, half)

    def disconnect():
        status, got = client.raw(
            json.dumps(client.body(prompts[-2], max_tokens=64, stream=True)).encode(), stream_events=2
        )
        return {"status": status, "events_read": got.count(b"data:")}

    def overlong():
        status, data = client.raw(json.dumps(client.body([1] + [7] * (CONTEXT + 88))).encode())
        return {"status": status, "expected": 400, "ok": status == 400, "body": data[:300].decode(errors="replace")}

    def malformed():
        cases = {
            "not_json": b"{this is not json",
            "prompt_not_ids": json.dumps(client.body("not token ids")).encode(),
            "negative_max_tokens": json.dumps(client.body([1, 5, 6], max_tokens=-3)).encode(),
        }
        got = {k: client.raw(v) for k, v in cases.items()}
        return {
            "statuses": {k: s for k, (s, _) in got.items()},
            "ok": all(400 <= s < 500 for s, _ in got.values()),
            "bodies": {k: b[:200].decode(errors="replace") for k, (_, b) in got.items()},
        }

    out["faults"] = [
        fault_round(client, n, f, prompts, baseline)
        for n, f in (("disconnect", disconnect), ("overlong", overlong), ("malformed", malformed))
    ]
    out["concurrent_after"] = check_round(client, prompts, baseline, [not x for x in half])
    out["pass"] = (
        out["concurrent"]["equal"] == n_clients
        and out["concurrent_after"]["equal"] == n_clients
        and all(f["serving_after"] and not f["others_differ"] for f in out["faults"])
        and all(f.get("ok", True) for f in out["faults"])
    )
    return out


def oov_probe_fn(client: Client) -> dict:
    """Token ids outside the vocabulary, then whether the server still answers (an engine property: the
    embedding runs before any attention backend; with ``--skip-tokenizer-init`` no tokenizer checks ids)."""
    prompt = requests(1)[0]
    want = client.generate(prompt)
    try:
        status, data = client.raw(json.dumps(client.body([1, 10**9, 5])).encode())
    except Exception as e:  # noqa: BLE001 - the server dropped the connection
        status, data = None, repr(e).encode()
    time.sleep(2)
    try:
        alive = client.generate(prompt) == want
    except Exception:  # noqa: BLE001
        alive = False
    return {"status": status, "body": data[:200].decode(errors="replace"), "serving_after": alive}


def start_server(engine: str, backend: str | None, model: str, log_path: Path, env: dict | None = None):
    """``vllm serve`` / ``sglang.launch_server`` on 127.0.0.1 in its own process group; returns (proc, port).
    ``env``: the server's whole environment (default: this process's)."""
    port = free_port()
    exe = Path(sys.executable)
    if engine == "vllm":
        cmd = [
            str(exe.with_name("vllm")),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(CONTEXT),
            "--max-num-seqs",
            "32",
            "--block-size",
            "16",
            "--seed",
            "0",
        ]
        if backend:
            cmd += ["--attention-backend", backend]
    else:
        cmd = [
            str(exe),
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--skip-tokenizer-init",
            "--disable-overlap-schedule",
            "--mem-fraction-static",
            "0.3",
            "--max-total-tokens",
            "8192",
            "--context-length",
            str(CONTEXT),
            "--max-running-requests",
            "32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--random-seed",
            "0",
            "--attention-backend",
            backend or "torch_native",
        ]
    full = {**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1"}  # env: the whole environment
    full.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=full, start_new_session=True)
    return proc, port


def serve_and_load(
    engine: str,
    backend: str | None,
    model: str,
    workdir: Path,
    n_clients: int = 32,
    env: dict | None = None,
    start_timeout: float = 600,
    oov_probe: bool = False,
) -> dict:
    """Start the server, run :func:`load_test`, stop it; the result has the server's fate and log size."""
    log = workdir / f"server-{engine}-{backend or 'native'}.log"
    t0 = time.time()
    proc, port = start_server(engine, backend, model, log, env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, start_timeout)
        res = {"engine": engine, "backend": backend or "native", "startup_seconds": round(time.time() - t0, 1)}
        client = Client(engine, port)
        res.update(load_test(client, n_clients))
        res["server_alive_at_end"] = proc.poll() is None
        res["pass"] = res["pass"] and res["server_alive_at_end"]
        if oov_probe:  # last, not part of the pass: it may take the server down
            res["engine_probe_ids_outside_vocab"] = oov_probe_fn(client)
    finally:
        stop_process_group(proc, signal.SIGINT, timeout=60)
    res["log"] = str(log)
    res["attnplug_active"] = "active (provider" in log.read_text(errors="replace")
    res["problems"] = problems(res)
    res["pass"] = not res["problems"]
    return res


def problems(res: dict) -> list[str]:
    """What a :func:`serve_and_load` result violates (empty: the server passed)."""
    out = []
    if not res.get("attnplug_active") and res.get("backend", "").startswith("attnplug"):
        out.append(f"attnplug did not run (log {res.get('log')})")
    for name in ("concurrent", "concurrent_after"):
        r = res.get(name) or {}
        if r.get("equal") != r.get("clients"):
            out.append(
                f"{name}: {r.get('equal')}/{r.get('clients')} answers equal the one-by-one ones: {r.get('differ')}"
            )
    for f in res.get("faults", []):
        if not (f.get("serving_after") and not f.get("others_differ") and f.get("ok", True)):
            out.append(f"fault {f.get('fault')}: {f}")
    if not res.get("server_alive_at_end"):
        out.append("the server process died")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m attnplug.bench.server_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--backend", default="attnplug_triton", help="attention backend (native: the engine's default)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--oov-probe", action="store_true", help="finally send token ids outside the vocabulary")
    args = ap.parse_args(argv)
    from ..tools.tiny_model import make_tiny_llama

    work = Path(args.workdir or tempfile.mkdtemp(prefix="attnplug-load-"))
    model = str(make_tiny_llama(work / "tiny-llama"))
    env = None
    if args.engine == "sglang":  # CPU engine; the test-only sgl_kernel shim of a checkout, if there is one
        shim = Path(__file__).resolve().parents[2] / "tests" / "sglang" / "sgl_kernel_shim"
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
        if shim.is_dir():
            env["PYTHONPATH"] = os.pathsep.join([str(shim)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    res = serve_and_load(
        args.engine,
        None if args.backend == "native" else args.backend,
        model,
        work,
        args.clients,
        env=env,
        oov_probe=args.oov_probe,
    )
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
