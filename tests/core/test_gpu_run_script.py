"""``scripts/gpu_run.sh --all`` exit status, summary and junit, on CPU.

Stand-ins replace the GPU commands (``ATTNPLUG_GPU_PYTEST`` / ``_BENCH`` / ``_WARMUP``): each step's
exit status is chosen per case, and the script must exit non-zero when any step fails. The last test
runs the real pytest on ``tests/gpu/test_gpu_selftest.py`` with ``ATTNPLUG_GPU_SELFTEST_FAIL=1``: the
deliberate GPU-suite failure the H200 run uses to show the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_PYTEST = textwrap.dedent("""
    import os, sys
    args = sys.argv[1:]
    if "--help" in args:
        print("usage: fake pytest (no --timeout option)"); sys.exit(0)
    k = args[args.index("-k") + 1] if "-k" in args else ""
    rc = int(os.environ["FAKE_RC_MAIN" if k.startswith("not ") else "FAKE_RC_FLASHINFER"])
    junit = next((a.split("=", 1)[1] for a in args if a.startswith("--junitxml=")), None)
    if junit:
        fail = '<failure message="fake"/>' if rc else ""
        open(junit, "w").write(
            f'<testsuite tests="1" failures="{int(rc != 0)}"><testcase name="fake">{fail}</testcase></testsuite>'
        )
    print("fake pytest", " ".join(args), "->", rc)
    sys.exit(rc)
""")


def run_gpu_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / ".attnplug-installed").touch()  # skip the wheel install of the GPU machine
    out = tmp_path / "out"
    e = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPLUG_GPU", "ATTNPLUG_FAIL_LOG", "FAKE_RC"))}
    e.update(ATTNPLUG_SITE=str(site), ATTNPLUG_GPU_DIR=str(tmp_path / "no-wheels"), ATTNPLUG_GPU_WARMUP="true", **env)
    e["CUDA_VISIBLE_DEVICES"] = ""  # the script's logic only: on a GPU machine, tests/gpu skip as on CPU
    r = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_run.sh"), "--all", str(out)],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r, out


@pytest.mark.parametrize(
    "main, flashinfer, bench, failing",
    [
        (0, 0, 0, []),
        (1, 0, 0, ["pytest_main"]),
        (0, 124, 0, ["pytest_flashinfer"]),
        (0, 0, 3, ["bench"]),
        (2, 1, 0, ["pytest_main", "pytest_flashinfer"]),
    ],
)
def test_exit_status_summary_and_junit(tmp_path, main, flashinfer, bench, failing):
    fake, fake_bench = tmp_path / "fake_pytest.py", tmp_path / "fake_bench.py"
    fake.write_text(FAKE_PYTEST)
    fake_bench.write_text("import os, sys\nsys.exit(int(os.environ['FAKE_RC_BENCH']))\n")
    r, out = run_gpu_run(
        tmp_path,
        ATTNPLUG_GPU_PYTEST=f"{sys.executable} {fake}",
        FAKE_RC_MAIN=str(main),
        FAKE_RC_FLASHINFER=str(flashinfer),
        ATTNPLUG_GPU_BENCH=f"{sys.executable} {fake_bench}",
        FAKE_RC_BENCH=str(bench),
    )
    log = r.stdout + r.stderr
    assert (r.returncode != 0) == bool(failing), log[-3000:]
    summary = (out / "summary.txt").read_text()
    for step in ("pytest_main", "pytest_flashinfer", "bench"):
        want = "FAIL" if step in failing else "PASS"
        assert any(line.split()[:2] == [step, want] for line in summary.splitlines()), summary
    assert summary.splitlines()[-1].startswith(f"overall: {'FAIL' if failing else 'PASS'} ({len(failing)} of 3")
    junit = (out / "gpu_run.junit.xml").read_text()
    assert f'tests="3" failures="{len(failing)}"' in junit and junit.count("<failure") == len(failing), junit
    assert (out / "pytest_triton_fa3.xml").exists() and (out / "pytest_flashinfer.xml").exists()
    assert "--timeout" not in (out / "pytest_triton_fa3.log").read_text()  # the stand-in has no pytest-timeout


@pytest.mark.parametrize("selftest_fail", ["1", "0"])
def test_deliberate_gpu_test_failure_makes_it_exit_nonzero(tmp_path, selftest_fail):
    """The real pytest on the opt-in failing GPU test (``ATTNPLUG_GPU_SELFTEST_FAIL=1``)."""
    r, out = run_gpu_run(
        tmp_path,
        ATTNPLUG_GPU_PYTEST=f"{sys.executable} -m pytest -p no:cacheprovider",
        ATTNPLUG_GPU_TEST_PATHS="tests/gpu/test_gpu_selftest.py",
        ATTNPLUG_GPU_BENCH="true",
        ATTNPLUG_GPU_SELFTEST_FAIL=selftest_fail,
    )
    log = r.stdout + r.stderr
    main_log = (out / "pytest_triton_fa3.log").read_text()
    if selftest_fail == "1":
        assert r.returncode == 1, log[-3000:]
        assert "1 failed" in main_log and "deliberate failure" in main_log, main_log
        assert 'failures="1"' in (out / "pytest_triton_fa3.xml").read_text()
        assert "pytest_main       FAIL (exit 1" in (out / "summary.txt").read_text()
    else:
        assert r.returncode == 0, log[-3000:]
        assert "1 skipped" in main_log and "opt-in: ATTNPLUG_GPU_SELFTEST_FAIL=1" in main_log, main_log
