"""scripts/test.sh on a machine short of disk: the suites' environments are built in order, and
when the next build would not fit, the environments this run built that no later suite reads are
removed first; a failed build is removed; a developer's own environments are never touched; a suite
that still does not fit fails with the space it needs. Every suite also keeps 1 GiB free for what its
tests write (``run_mib``: engine sources, models, caches).

The script runs for real with two stand-ins: ``run_suite`` (each suite "builds" its environments as
empty folders) and ``df`` (free space = a capacity minus the measured size of every environment that
exists). What is checked is the order and the removals, which is the logic the CI depends on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALL = [
    "lint",
    "core",
    "mutation",
    "sm90-aot",
    "package",
    "newest",
    "vllm",
    "vllm026",
    "peer-vllm",
    "sglang",
    "sglang0517",
    "peer-sglang",
]
# MiB of each environment as measured (scripts/test.sh's comment), for the fake df
SIZE = {
    "core": 1779,
    "triton-3.6.0": 666,
    "pkg": 50,
    "newest": 5795,
    "vllm": 3501,
    "vllm026-unit": 436,
    "sglang": 7024,
    "sglang0517": 423,
}

FAKE_DF = """#!/usr/bin/env bash
# df -Pk PATH: the capacity CAP_MIB minus the environments that exist; the shm folder: SHM_GIB
declare -A size=(%s)
if [[ ${@: -1} == "$ATTNPLUG_BUILD_SHM" ]]; then echo header; echo "shm 1 1 $((SHM_GIB * 1048576)) 1 shm"; exit; fi
used=0
for v in "${!size[@]}"; do [[ -d .venvs/$v ]] && used=$((used + size[$v])); done
echo header; echo "disk 1 1 $(( (CAP_MIB - used) * 1024 )) 1 /"
"""

# every suite "builds" what it reads; FAIL_BUILD names one whose build fails; LOG records each build
STUB = r"""run_suite() {
  local v; build_failed=0
  for v in ${uses[$1]:-}; do
    [[ -d .venvs/$v ]] || { mkdir -p ".venvs/$v"; echo "build $v" >> "$LOG"; }
  done
  echo "run $1 $(ls .venvs | tr '\n' ' ')" >> "$LOG"; echo "tmp ${build_tmp:-none}" >> "$LOG"
  if [[ $1 == "${FAIL_BUILD:-}" ]]; then build_failed=1; status=1; matrix+=("$1 | environment build failed | FAIL")
  else matrix+=("$1 | stub | PASS"); fi
}
"""


def run_test_sh(
    tmp_path: Path,
    cap_gib: float,
    shm_gib: int = 0,
    fail_build: str = "",
    existing: tuple[str, ...] = (),
    suites: tuple[str, ...] = (),
) -> tuple[int, str, list[str]]:
    script = (REPO / "scripts" / "test.sh").read_text()
    assert script.count('  run_suite "$s"\n') == 1 and "\nrun_suite() {" in script
    script = script.replace('cd "$(dirname "$0")/.."', f'cd "{tmp_path}"')
    # the stand-in is defined after the real one (the later definition wins)
    script = script.replace("export PIP_NO_CACHE_DIR=1", STUB + "export PIP_NO_CACHE_DIR=1", 1)
    (tmp_path / "test.sh").write_text(script)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "df").write_text(FAKE_DF % " ".join(f"[{k}]={v}" for k, v in SIZE.items()))
    (bindir / "df").chmod(0o755)
    for v in existing:
        (tmp_path / ".venvs" / v).mkdir(parents=True)
    log = tmp_path / "log"
    log.touch()
    shm = tmp_path / "shm"
    shm.mkdir()
    env = dict(
        os.environ,
        PATH=f"{bindir}:{os.environ['PATH']}",
        CAP_MIB=str(int(cap_gib * 1024)),
        SHM_GIB=str(shm_gib),
        FAIL_BUILD=fail_build,
        LOG=str(log),
        ATTNPLUG_BUILD_SHM=str(shm),
    )
    r = subprocess.run(
        ["bash", str(tmp_path / "test.sh"), *suites], capture_output=True, text=True, env=env, timeout=120
    )
    return r.returncode, r.stdout + r.stderr, log.read_text().splitlines()


def builds(log: list[str]) -> list[str]:
    return [line.split()[1] for line in log if line.startswith("build ")]


def ran(log: list[str]) -> list[str]:
    return [line.split()[1] for line in log if line.startswith("run ")]


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_plenty_of_disk_keeps_everything(tmp_path):
    rc, out, log = run_test_sh(tmp_path, cap_gib=80)
    assert rc == 0, out
    assert ran(log) == ALL
    assert "removed" not in out
    assert sorted(builds(log)) == sorted(SIZE)  # each environment built once
    assert sorted(p.name for p in (tmp_path / ".venvs").iterdir()) == sorted(SIZE)


@pytest.mark.parametrize("cap_gib, shm_gib", [(9.0, 24), (10.2, 0)])
def test_a_small_disk_prunes_and_every_suite_runs(tmp_path, cap_gib, shm_gib):
    rc, out, log = run_test_sh(tmp_path, cap_gib=cap_gib, shm_gib=shm_gib)
    assert rc == 0, out
    assert ran(log) == ALL
    b = builds(log)
    assert sorted(b) == sorted(SIZE), b  # nothing a later suite reads was removed and built again
    removed = re.findall(r"removed \.venvs/(\S+) \(built by this run", out)
    assert {"core", "newest", "vllm"} <= set(removed), out
    # when each suite ran, what it reads was there
    uses = {
        "vllm026": {"vllm", "vllm026-unit"},
        "sglang0517": {"sglang", "sglang0517"},
        "sm90-aot": {"core"},
        "peer-vllm": {"vllm"},
        "peer-sglang": {"sglang"},
    }
    for line in log:
        if line.startswith("run "):
            suite, present = line.split()[1], set(line.split()[2:])
            assert uses.get(suite, set()) <= present, line


def test_too_small_fails_with_the_space_it_needs(tmp_path):
    rc, out, log = run_test_sh(tmp_path, cap_gib=8.0, shm_gib=24)
    assert rc == 1
    assert not {"sglang", "sglang0517", "peer-sglang"} & set(ran(log))
    # sglang's 7.2 GiB and the 1 GiB every suite keeps for its tests' files
    assert re.search(
        r"suite sglang \(building \.venvs/\{sglang\}, and its tests' files\) needs about 8\.2 GiB free here; "
        r"only 8\.0 GiB are",
        out,
    ), out
    assert "sglang | not enough disk | - | - | - | FAIL" in out
    assert re.search(r"matrix: 9 passed, 3 failed", out), out


def test_newest_downloads_count_without_shm(tmp_path):
    # 9.0 GiB: newest's 6.2 GiB (+ 1 for its tests) fit, its downloads (3.0 GiB) do not unless they go to /dev/shm
    rc, out, log = run_test_sh(tmp_path, cap_gib=9.0, shm_gib=0)
    assert rc == 1 and "newest" not in ran(log)
    assert "newest | not enough disk" in out
    (tmp_path / "again").mkdir()
    rc, out, log = run_test_sh(tmp_path / "again", cap_gib=9.0, shm_gib=24)
    assert rc == 0 and ran(log) == ALL, out


def test_a_failed_build_is_removed_and_built_again_by_the_next_suite(tmp_path):
    rc, out, log = run_test_sh(tmp_path, cap_gib=80, fail_build="vllm")
    assert rc == 1
    assert "removed the half-built .venvs/vllm" in out
    assert builds(log).count("vllm") == 2  # vllm026 builds its source again


def test_existing_environments_are_never_removed(tmp_path):
    # a developer's newest and sglang exist; the disk is short for the rest
    rc, out, log = run_test_sh(tmp_path, cap_gib=8.0 + (5795 + 7024) / 1024, shm_gib=24, existing=("newest", "sglang"))
    assert rc == 0, out
    assert "newest" not in builds(log) and "sglang" not in builds(log)
    assert not re.search(r"removed \.venvs/(newest|sglang) ", out), out
    assert (tmp_path / ".venvs" / "newest").is_dir() and (tmp_path / ".venvs" / "sglang").is_dir()


def test_what_a_later_suite_reads_is_never_pruned(tmp_path):
    # 4.8 GiB: vllm (3.7 GiB + 1 GiB for its tests) fits once core and the overlays are removed; its
    # clone then does not fit, and the only thing that would make room is vllm itself, which the
    # clone's suite reads
    rc, out, log = run_test_sh(
        tmp_path, cap_gib=(3900 + 1024) / 1024, shm_gib=24, suites=("core", "sm90-aot", "vllm", "vllm026")
    )
    assert rc == 1
    assert ran(log) == ["core", "sm90-aot", "vllm"]
    assert builds(log).count("vllm") == 1 and (tmp_path / ".venvs" / "vllm").is_dir()
    assert set(re.findall(r"removed \.venvs/(\S+) ", out)) == {"core", "triton-3.6.0"}, out
    assert "vllm026 | not enough disk" in out


def test_the_download_folder_is_removed_at_the_end(tmp_path):
    (tmp_path / "again").mkdir()
    rc, out, log = run_test_sh(tmp_path, cap_gib=80, shm_gib=24, suites=("package",))
    assert rc == 0, out
    tmp = {line.split()[1] for line in log if line.startswith("tmp ")}
    assert len(tmp) == 1 and Path(tmp.pop()).parent == tmp_path / "shm", log  # the builds' folder was in shm
    assert list((tmp_path / "shm").iterdir()) == []  # and is gone after the run
    rc, out, log = run_test_sh(tmp_path / "again", cap_gib=80, shm_gib=2, suites=("package",))
    assert {line for line in log if line.startswith("tmp ")} == {"tmp none"}  # too small: the disk's /tmp
