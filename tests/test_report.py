"""verifier.report (the table and context every report prints) and its re-export in recipes.benchutil."""

from __future__ import annotations

import json

from recipes import benchutil
from verifier import report


def test_format_table_aligns_and_formats():
    rows = [{"op": "gemm", "ms": 1.234567, "note": None}, {"op": "attention_fwd", "ms": 12345.0, "note": "x"}]
    lines = report.format_table(rows).splitlines()
    assert lines[0].split() == ["op", "ms", "note"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["gemm", "1.235"]          # 4 significant digits, None left blank
    assert lines[3].split() == ["attention_fwd", "1.234e+04", "x"]
    assert len({len(line) for line in lines}) == 1          # every line equally wide: columns align
    assert report.format_table(rows, columns=["ms"]).splitlines()[0].strip() == "ms"
    assert report.format_table([]) == "(no rows)"


def test_benchutil_reexports_and_writes_json(tmp_path, capsys):
    assert benchutil.format_table is report.format_table and benchutil.context is report.context
    path = tmp_path / "bench.json"
    benchutil.print_report("demo", [{"impl": "ours", "ms": 2.0}, {"impl": "torch", "ms": 3.0}], json_path=path,
                           notes=["tiny sizes"])
    out = capsys.readouterr().out
    assert "== demo ==" in out and "backend=cpu" in out and "say nothing about a GPU" in out
    doc = json.loads(path.read_text())
    assert doc["rows"][1] == {"impl": "torch", "ms": 3.0} and doc["notes"] == ["tiny sizes"]
    assert {"date", "backend", "device", "torch", "triton", "triton_interpreted"} <= set(doc["context"])
