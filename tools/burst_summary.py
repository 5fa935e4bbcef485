"""Warm bursts of a ``tools/bench_sglang.py`` run as median and spread, route over stock.

``bench_sglang --bursts B`` sends each stream count B times in a row; the first burst is the
server's first batch of that size (graph warm-up, allocator growth) and is left out here. Per
mode and stream count this reports the median, min and max over the warm bursts of the
burst-adjusted inter-token p50 (tokens counted, not chunks) and of the time per output token,
then each mode's median over stock's::

    python -m tools.burst_summary bench/results/sglang-peer-gpu1-h200x2.json --write

``--write`` stores the table in the JSON under ``warm_bursts`` (the file is otherwise unchanged).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

METRICS = ("inter_token_burst_adjusted_p50_ms", "tpot_p50_ms")


def warm(first: dict[str, Any]) -> list[dict[str, Any]]:
    """The warm bursts of one stream count: the repeats after the first."""
    return list(first.get("repeats", []))


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Per regime, mode and stream count: ``{metric: {median, min, max, n}}``, and per mode
    other than stock ``over_stock`` (its medians over stock's)."""
    out: dict[str, Any] = {}
    for regime, r in run["regimes"].items():
        by_mode: dict[str, Any] = {}
        for mode, by_streams in r.get("concurrent_by_streams", {}).items():
            for streams, first in by_streams.items():
                bursts = warm(first)
                if not bursts:
                    continue
                cell = {}
                for m in METRICS:
                    xs = [b[m] for b in bursts if b.get(m) is not None]
                    if xs:
                        cell[m] = {"median": statistics.median(xs), "min": min(xs),
                                   "max": max(xs), "n": len(xs)}  # fmt: skip
                by_mode.setdefault(mode, {})[streams] = cell
        stock = by_mode.get("stock", {})
        for mode, cells in by_mode.items():
            if mode == "stock":
                continue
            for streams, cell in cells.items():
                ref = stock.get(streams, {})
                cell["over_stock"] = {
                    m: round(cell[m]["median"] / ref[m]["median"], 3)
                    for m in METRICS
                    if m in cell and m in ref and ref[m]["median"]
                }
        out[regime] = by_mode
    return out


def table(summary: dict[str, Any]) -> str:
    rows = ["regime  mode    streams  itl adj median [min–max] ms  tpot median ms  itl / stock"]
    for regime, by_mode in summary.items():
        for mode, cells in by_mode.items():
            for streams, c in sorted(cells.items(), key=lambda kv: int(kv[0])):
                itl, tpot = c.get(METRICS[0]), c.get(METRICS[1])
                if itl is None or tpot is None:
                    continue
                ratio = c.get("over_stock", {}).get(METRICS[0])
                rows.append(
                    f"{regime:7s} {mode:7s} {streams:>7s}  {itl['median']:6.2f} "
                    f"[{itl['min']:.2f}–{itl['max']:.2f}] (n={itl['n']})     {tpot['median']:6.2f}"
                    f"          {'' if ratio is None else f'{ratio:.2f}×'}"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="a tools/bench_sglang.py result")
    ap.add_argument("--write", action="store_true", help="store the summary in the JSON")
    a = ap.parse_args(argv)
    run = json.loads(a.json.read_text())
    s = summarize(run)
    print(table(s))
    if a.write:
        run["warm_bursts"] = {"first_burst_dropped": True, "by_regime": s}
        a.json.write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
