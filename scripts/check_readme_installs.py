"""Every `pip install` line of README.md resolves: pip's resolver, without installing anything.

    python scripts/check_readme_installs.py [--readme README.md] [--list]

Reads the lines from README.md's ```bash blocks (so README and this check cannot drift), runs each as
`python -m pip install --dry-run --ignore-installed --report ...` from the checkout's root (`.` is this
checkout) with what a user's machine has: PyPI and no pip configuration of this machine's (its
configuration files cap torch at the release kept on disk). A version the line's comment states
(`torch 2.11.0`, `triton >= 3.7`) must be what pip picks. Prints one line per install line; exits 1 if
any does not resolve or its comment is wrong. Needs network access to PyPI; a line takes ~1 min.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # one line: pip fetches only metadata (PEP 658), but the index can be slow
#: PIP_* variables of this machine that a user's machine does not have (indexes, caps)
MACHINE_PIP_ENV = (
    "PIP_CONFIG_FILE",
    "PIP_CONSTRAINT",
    "PIP_FIND_LINKS",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_NO_INDEX",
    "PIP_REQUIRE_VIRTUALENV",
)
CLAIM = re.compile(r"\b(torch|triton) (>= ?)?(\d+(?:\.\d+)+)")


def install_lines(readme: str) -> list[tuple[str, str]]:
    """``(command, comment)`` of every line of a ```bash block that starts with ``pip install``."""
    out, in_bash = [], False
    for line in readme.splitlines():
        s = line.strip()
        if s.startswith("```"):
            in_bash = s == "```bash" and not in_bash
            continue
        if in_bash and s.startswith("pip install "):
            cmd, _, comment = s.partition(" #")
            out.append((cmd.strip(), comment.strip()))
    return out


def claims(comment: str) -> list[tuple[str, str, str]]:
    """``(package, "==" or ">=", version)`` stated in an install line's comment."""
    return [(name, ">=" if ge else "==", v) for name, ge, v in CLAIM.findall(comment)]


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def check_claims(resolved: dict[str, str], comment: str) -> list[str]:
    """What the comment states that pip did not pick (empty: all true)."""
    bad = []
    for name, op, v in claims(comment):
        got = resolved.get(name)
        ok = got is not None and (_vtuple(got) >= _vtuple(v) if op == ">=" else _vtuple(got) == _vtuple(v))
        if not ok:
            bad.append(f"the comment says {name} {op} {v}, pip picks {got}")
    return bad


def resolve(cmd: str) -> tuple[dict[str, str] | None, str]:
    """``({package: version}, "")`` pip would install for ``cmd``, or ``(None, pip's error)``."""
    args = shlex.split(cmd)[2:]  # after "pip install"
    env = {k: v for k, v in os.environ.items() if k not in MACHINE_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull  # no configuration file: pip's defaults (PyPI)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--disable-pip-version-check",
                "--report",
                str(report),
                *args,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if r.returncode != 0 or not report.exists():
            return None, (r.stderr or r.stdout).strip()[-1500:]
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in items}, ""


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python scripts/check_readme_installs.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--list", action="store_true", help="print the lines found, resolve nothing")
    args = ap.parse_args()
    lines = install_lines(args.readme.read_text())
    if not lines:
        print(f"readme installs: no `pip install` line in a ```bash block of {args.readme}")
        return 1
    failed = 0
    for cmd, comment in lines:
        if args.list:
            print(f"{cmd}    # {comment}" if comment else cmd)
            continue
        t0 = time.time()
        try:
            resolved, err = resolve(cmd)
        except subprocess.TimeoutExpired:
            resolved, err = None, f"pip did not finish in {TIMEOUT_S} s"
        if resolved is None:
            failed += 1
            print(f"FAIL  {cmd}\n      {err.replace(chr(10), chr(10) + '      ')}")
            continue
        bad = check_claims(resolved, comment)
        failed += bool(bad)
        picks = ", ".join(
            f"{p} {resolved[p]}"
            for p in ("attnplug", "vllm", "sglang", "torch", "triton", "flashinfer-python")
            if p in resolved
        )
        print(
            f"{'FAIL' if bad else 'ok  '}  {cmd}  ->  {picks}  ({time.time() - t0:.0f} s)"
            + "".join(f"\n      {b}" for b in bad),
            flush=True,
        )
    if not args.list:
        print(f"readme installs: {len(lines) - failed}/{len(lines)} pip install lines of README.md resolve")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
