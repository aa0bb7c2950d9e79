"""An engine's HTTP server as a local subprocess (the demos and the engine tests): a free port, the
wait for ``/health``, a JSON POST, and stopping the server's whole process group.

Stdlib only (urllib), so it imports in every engine environment.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log_path: str | os.PathLike, n: int = 6000) -> str:
    return Path(log_path).read_text(errors="replace")[-n:]


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str | os.PathLike, timeout: float) -> None:
    """Return once ``GET url/health`` answers 200.

    Raises:
        RuntimeError: the server exited first, or was not ready within ``timeout`` s (with its log's tail).
    """
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready in {timeout} s:\n{_tail(log_path)}")


def post_json(url: str, payload: dict, timeout: float) -> object:
    """``POST`` ``payload`` as JSON to ``url``; returns the decoded JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stop_process_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Send ``sig`` to the server's process group (started with ``start_new_session=True``), then
    SIGKILL it if it has not exited after ``timeout`` s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def active_line(log_text: str, marker: str) -> str | None:
    """The first line of a server log holding ``marker`` (attnplug's, e.g. ``"attnplug: ATTNPLUG_TRITON
    active"``), from the marker to the end of the line; ``None`` when no line has it."""
    for line in log_text.splitlines():
        i = line.find(marker)
        if i >= 0:
            return line[i:].strip()
    return None


def error_line(log_text: str, n: int = 400) -> str:
    """The last line of a failed server's log that names an error (attnplug's own first), for one line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for pick in (
        lambda ln: "attnplug:" in ln and ("Error" in ln or "must" in ln or "not" in ln),
        lambda ln: "Error" in ln or "error" in ln,
    ):
        hits = [ln for ln in lines if pick(ln)]
        if hits:
            return hits[-1][-n:]
    return lines[-1][-n:] if lines else "(empty log)"


def verdict(engine: str, same: bool, detail: str, active: str | None) -> int:
    """Print a demo's last line, ``PASS <engine>: ...`` or ``FAIL <engine>: ...``, quoting attnplug's active
    line; returns the exit status: 0 only when the tokens are the same and the active line was logged."""
    if active is None:
        print(f"FAIL {engine}: attnplug's active line is missing from the server log ({detail})", flush=True)
        return 1
    print(f'{"PASS" if same else "FAIL"} {engine}: {detail}; active line: "{active}"', flush=True)
    return 0 if same else 1
