"""GPU lanes for the offline device machine: one daemon per GPU runs its queued jobs one at a time.

The device machine is released ~30 s after a call and takes at most 64 MiB per call, so a long run
is fed over several calls: the first call starts the daemons (in their own session, so they outlive
the call) and queues every job; later calls carry the next payload, unpack it and touch a marker
file that the waiting jobs name in ``needs``; the last calls ``wait`` and collect.

    python lanes.py start ROOT --gpus 0,1
    python lanes.py add ROOT --gpu 0 --name vllm-FLASH_ATTN --needs /tmp/vsite/.ready --timeout 420 -- CMD...
    python lanes.py wait ROOT --max 500 --out $OUT       # returns when every queue is empty or after --max s

A job runs as ``bash -c CMD`` with CUDA_VISIBLE_DEVICES set to its lane's GPU, stdout+stderr to
ROOT/logs/NAME.log, in its own process group (killed whole when it ends or times out). Its status
(rc, seconds) goes to ROOT/status/NAME.json. One GPU, one job at a time: timings never share a GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tarfile
import time


def _jobs(root: str, gpu: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, f"gpu{gpu}", "queue", "*.json")))


def daemon(root: str, gpu: str) -> None:
    qdir = os.path.join(root, f"gpu{gpu}")
    open(os.path.join(qdir, "daemon.pid"), "w").write(str(os.getpid()))
    while True:
        jobs = _jobs(root, gpu)
        if not jobs:
            time.sleep(1)
            continue
        path = jobs[0]
        job = json.load(open(path))
        name = job["name"]
        status_path = os.path.join(root, "status", name + ".json")
        t_wait = time.time()
        while not all(os.path.exists(n) for n in job.get("needs", [])):
            if time.time() - t_wait > job.get("needs_timeout", 1500):
                break
            time.sleep(1)
        missing = [n for n in job.get("needs", []) if not os.path.exists(n)]
        json.dump({"name": name, "gpu": gpu, "state": "running", "start": time.time()}, open(status_path, "w"))
        t0 = time.time()
        if missing:
            rc, state = -2, f"skipped: missing {missing}"
        else:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1", **job.get("env", {}))
            with open(os.path.join(root, "logs", name + ".log"), "w") as log:
                p = subprocess.Popen(
                    ["bash", "-c", job["cmd"]], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                try:
                    rc, state = p.wait(timeout=job.get("timeout", 600)), "done"
                except subprocess.TimeoutExpired:
                    rc, state = -1, "timeout"
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # engines leave worker processes behind
                except ProcessLookupError:
                    pass
            time.sleep(3)  # let the driver release the GPU memory of killed processes
        json.dump(
            {"name": name, "gpu": gpu, "state": state, "rc": rc, "secs": round(time.time() - t0, 1), "start": t0},
            open(status_path, "w"),
        )
        os.rename(path, os.path.join(qdir, "done", os.path.basename(path)))


def start(root: str, gpus: list[str]) -> None:
    for sub in ("logs", "status"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for g in gpus:
        for sub in ("queue", "done"):
            os.makedirs(os.path.join(root, f"gpu{g}", sub), exist_ok=True)
        pid_file = os.path.join(root, f"gpu{g}", "daemon.pid")
        if os.path.exists(pid_file):
            try:
                os.kill(int(open(pid_file).read()), 0)
                continue  # already running
            except (ProcessLookupError, ValueError):
                pass
        log = open(os.path.join(root, f"daemon{g}.log"), "a")
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_daemon", root, g],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"lanes: daemons for GPUs {gpus} under {root}", flush=True)


def add(root: str, gpu: str, name: str, cmd: str, needs: list[str], timeout: int, env: dict) -> None:
    q = os.path.join(root, f"gpu{gpu}", "queue")
    n = len(os.listdir(q)) + len(os.listdir(os.path.join(root, f"gpu{gpu}", "done")))
    job = {"name": name, "cmd": cmd, "needs": needs, "timeout": timeout, "env": env}
    json.dump(job, open(os.path.join(q, f"{n:03d}-{name}.json"), "w"))


def summary(root: str) -> tuple[str, bool]:
    lines, busy = [], False
    for g in sorted(glob.glob(os.path.join(root, "gpu*"))):
        queued = [os.path.basename(p)[4:-5] for p in sorted(glob.glob(os.path.join(g, "queue", "*.json")))]
        busy |= bool(queued)
        lines.append(f"{os.path.basename(g)} queued: {queued}")
    for s in sorted(glob.glob(os.path.join(root, "status", "*.json")), key=os.path.getmtime):
        st = json.load(open(s))
        extra = f"rc={st.get('rc')} {st.get('secs')}s" if "rc" in st else f"{time.time() - st['start']:.0f}s so far"
        lines.append(f"  {st['name']}: {st['state']} {extra}")
    return "\n".join(lines), busy


def wait(root: str, max_s: float, out: str | None, results: str | None) -> None:
    t0, last = time.time(), 0.0
    while True:
        text, busy = summary(root)
        if not busy or time.time() - t0 > max_s:
            break
        if time.time() - last > 60:
            print(f"--- {time.time() - t0:.0f}s\n{text}", flush=True)
            last = time.time()
        time.sleep(2)
    print(f"=== lanes after {time.time() - t0:.0f}s\n{text}", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with tarfile.open(os.path.join(out, "lanes-logs.tar.gz"), "w:gz") as tar:
            tar.add(root, arcname="lanes")
            if results and os.path.isdir(results):
                tar.add(results, arcname="results")
        for s in sorted(glob.glob(os.path.join(root, "status", "*.json"))):
            st = json.load(open(s))
            if st.get("state") not in ("running",) and st.get("rc") not in (0, None):
                log = os.path.join(root, "logs", st["name"] + ".log")
                if os.path.exists(log):
                    tail = open(log, errors="replace").read().splitlines()[-25:]
                    print(f"--- tail of failed {st['name']}:\n" + "\n".join(tail), flush=True)


def main() -> None:
    if sys.argv[1] == "_daemon":
        daemon(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("root")
    s.add_argument("--gpus", default="0")
    s = sub.add_parser("add")
    s.add_argument("root")
    s.add_argument("--gpu", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--needs", action="append", default=[])
    s.add_argument("--timeout", type=int, default=600)
    s.add_argument("--env", action="append", default=[])
    s = sub.add_parser("wait")
    s.add_argument("root")
    s.add_argument("--max", type=float, default=500)
    s.add_argument("--out", default=None)
    s.add_argument("--results", default=None)
    argv = sys.argv[1:]
    job = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.cmd == "start":
        start(a.root, a.gpus.split(","))
    elif a.cmd == "add":
        add(a.root, a.gpu, a.name, " ".join(job), a.needs, a.timeout, dict(e.split("=", 1) for e in a.env))
    else:
        wait(a.root, a.max, a.out, a.results)


if __name__ == "__main__":
    main()
