"""tools/summarize_results.py: a result's raw sample lists become summaries, the original is
gzip'd beside it and loads back unchanged, short lists and other fields stay, a second run
changes nothing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tools.summarize_results import load_full, main, summarize, summarize_list


def _result(n: int = 200) -> dict:  # type: ignore[type-arg]
    return {
        "what": "a fan-in run",
        "samples": [{"t_s": i * 0.5, "fanin": i % 7, "phase": "x"} for i in range(n)],
        "per_second": [{"t_s": i, "p99_ms": float(i), "p50_ms": None} for i in range(n // 2)],
        "events": [{"t_s": 1.0, "event": "added"}],
        "errors": [],
    }


def test_summary_keeps_counts_and_percentiles_and_the_raw_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    full = _result()
    path.write_text(json.dumps(full, indent=1))
    before = path.stat().st_size
    assert summarize(path)
    out = json.loads(path.read_text())
    assert out["raw_samples"]["file"] == "run.json.gz"
    assert out["raw_samples"]["keys"] == ["samples", "per_second"]
    assert out["events"] == full["events"] and out["errors"] == [] and out["what"] == full["what"]
    s = out["samples"]
    assert s["count"] == 200 and set(s["fields"]) == {"t_s", "fanin"}  # "phase" is no number
    assert s["fields"]["fanin"] == {
        "n": 200, "min": 0.0, "p50": 3.0, "p90": 6.0, "p99": 6.0, "max": 6.0, "mean": 2.97,
    }  # fmt: skip
    p99 = out["per_second"]["fields"]["p99_ms"]
    got = (p99["n"], p99["p50"], p99["p90"], p99["p99"], p99["max"])
    assert got == (100, 49.0, 89.0, 98.0, 99.0)
    assert "p50_ms" not in out["per_second"]["fields"]  # all None: left out
    assert load_full(path) == full
    assert path.stat().st_size < before / 4
    gz = (tmp_path / "run.json.gz").read_bytes()
    assert not summarize(path), "a summary was summarised again"
    assert (tmp_path / "run.json.gz").read_bytes() == gz and json.loads(path.read_text()) == out


def test_short_or_sampleless_results_are_left_alone(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    short, plain = tmp_path / "short.json", tmp_path / "plain.json"
    short.write_text(json.dumps(_result(10)))
    plain.write_text(json.dumps({"rows": [1, 2, 3]}))
    texts = short.read_text(), plain.read_text()
    main([str(short), str(plain)])
    assert (short.read_text(), plain.read_text()) == texts
    assert not list(tmp_path.glob("*.gz")) and capsys.readouterr().out.count("unchanged") == 2
    assert load_full(plain) == {"rows": [1, 2, 3]}


def test_the_gzip_is_the_same_bytes_for_the_same_input(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(_result()))
        assert summarize(tmp_path / name / "run.json")
    a, b = (tmp_path / n / "run.json.gz" for n in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(gzip.decompress(a.read_bytes())) == _result()
    assert summarize_list([1, 2, 3])["fields"]["value"]["p50"] == 2.0
