"""``python -m attnplug.bench``'s output (attnplug/bench/report.py): one markdown table per row kind with
only the records that ran, the n/a reasons in one footnote, and a printed notice when the PNG cannot be
drawn."""

from __future__ import annotations

import json
import sys

from attnplug.bench import report


def _res():
    rows = []
    for kind, row in (("decode", "decode 4x64"), ("decode", "decode 1x256"), ("prefill", "prefill 2x128")):
        rows += [
            dict(
                row=row,
                kind=kind,
                impl="attnplug.triton",
                ms=0.5,
                GBps=100.0,
                TFLOPs=2.0,
                err=1e-3,
                status="ok",
                vs_best_lib=1.2,
                plan_ms=0.1,
            ),
            dict(
                row=row,
                kind=kind,
                impl="flashinfer.decode_tc",
                ms=0.6,
                GBps=90.0,
                TFLOPs=1.5,
                err=1e-3,
                status="ok",
                library=True,
            ),
            dict(row=row, kind=kind, impl="fa3.paged", status="unavailable: it needs a Hopper GPU"),
            dict(row=row, kind=kind, impl="torch.gather_sdpa", status="n/a: decode kernel"),
        ]
    rows.append(
        dict(
            row="prefill 2x128",
            kind="prefill",
            impl="attnplug.flashinfer",
            status="error: RuntimeError: Ninja build failed.\nninja: | stop",
        )
    )
    rows.append(dict(row="verify 2x(64+8 tree)", kind="verify", impl="fa3.paged", status="n/a: no tree mask"))
    return {
        "env": {"device": "cpu (x86_64)", "date": "2026-12-05", "torch": "2.13"},
        "ceilings": {},
        "shape": "8 q heads",
        "rows": rows,
    }


def _tables(md: str) -> dict[str, list[str]]:
    """kind -> the table lines under its '## kind' heading."""
    out, kind = {}, None
    for line in md.splitlines():
        if line.startswith("## "):
            kind = line[3:]
            out[kind] = []
        elif kind and line.startswith("|"):
            out[kind].append(line)
        elif kind and line and not line.startswith("|"):
            kind = None
    return out


def test_markdown_one_table_per_kind_without_not_run_rows():
    md = report.markdown(_res())
    tables = _tables(md)
    assert list(tables) == ["decode", "prefill"]  # verify ran nothing: no table
    assert len(tables["decode"]) == 2 + 4 and len(tables["prefill"]) == 2 + 3  # header, rule, records
    body = "\n".join(line for t in tables.values() for line in t)
    assert "n/a" not in body and "unavailable" not in body and "fa3.paged" not in body
    for t in tables.values():  # every record one line, as many cells as the header
        assert len({line.count("|") for line in t}) == 1, t
    assert "GB/s" in tables["decode"][0] and "TFLOP/s" in tables["prefill"][0]
    assert "anchor" not in tables["decode"][0]  # a column empty for every record is left out
    assert "Ninja build failed. ninja: / stop" in tables["prefill"][-1]  # a failure stays in its table
    foot = md[md.index("Not run (7 records") :]
    assert "- fa3.paged: unavailable: it needs a Hopper GPU (decode 4x64, decode 1x256, prefill 2x128)" in foot
    assert "- torch.gather_sdpa: n/a: decode kernel (decode 4x64, decode 1x256, prefill 2x128)" in foot
    assert "- fa3.paged: n/a: no tree mask (verify 2x(64+8 tree))" in foot
    assert foot.count("\n- ") == 3


def test_summary_leaves_not_run_records_out():
    text = report.summary(_res())
    assert "n/a: decode kernel" not in text and "fa3.paged" not in text
    assert "(7 records not run" in text and "Ninja" in text


def test_write_without_matplotlib_prints_a_notice(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = _res()
    paths = report.write(res, str(tmp_path), "run", png=True)
    assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "md"]
    err = capsys.readouterr().err
    assert "attnplug.bench: no plot" in err and "matplotlib is not installed" in err and "[bench]" in err
    assert json.loads((tmp_path / "run.json").read_text())["rows"] == res["rows"]
    assert not (tmp_path / "run.png").exists()


def test_write_draws_the_png_with_matplotlib(tmp_path, capsys):
    import matplotlib  # noqa: F401 - the core environment has it (attnplug[bench])

    paths = report.write(_res(), str(tmp_path), "run", png=True)
    assert paths[-1].endswith("run.png") and (tmp_path / "run.png").stat().st_size > 1000
    assert "no plot" not in capsys.readouterr().err
