"""tools/fanin_report.replot: a saved bench_fanin JSON (a --plot none run) becomes its plot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tools.fanin_report import replot
from tools.summarize_results import load_full

RESULT = Path(__file__).resolve().parents[2] / "bench/results/fanin-replicas-16core-speed-run1.json"


def test_replot_draws_a_saved_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib: pip install -e '.[test]'")
    src = tmp_path / RESULT.name
    shutil.copy(RESULT, src)
    if RESULT.with_name(RESULT.name + ".gz").exists():  # a summary: its samples are beside it
        shutil.copy(RESULT.with_name(RESULT.name + ".gz"), tmp_path)
    png = replot(src)
    assert png == src.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_replot_without_matplotlib_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    real = builtins.__import__

    def no_matplotlib(name: str, *a: object, **kw: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real(name, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    src = tmp_path / "run.json"
    src.write_text(json.dumps(load_full(RESULT)))
    assert replot(src) is None
    assert not (tmp_path / "run.png").exists()
