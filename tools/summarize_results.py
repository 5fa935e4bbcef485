"""Rewrite a result JSON's raw per-sample lists as summaries, the raw data gzip'd beside it.

A fan-in run (tools/bench_fanin.py) records every 0.5 s sample and every second's latencies:
~3k lines of JSON per run, most of them timeline. This keeps in the JSON what a reader compares
(per field: count, min, p50, p90, p99, max, mean) and moves the whole original, byte for byte
as parsed, into ``<name>.json.gz`` beside it; the summary names that file in ``raw_samples``.
Readers that need the timeline (``tools/fanin_report.replot``) load it with :func:`load_full`.
The plots (``<name>.png``) are not touched. Running it twice changes nothing.

    python -m tools.summarize_results bench/results/fanin-replicas-*.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Any

# Top-level lists that are raw samples in the results that have them (bench_fanin's timeline).
SAMPLE_KEYS = ("samples", "per_second")
MIN_SAMPLES = 20  # a shorter list stays as it is: it reads fine and a summary would lose more


def _percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``xs`` (q in [0, 100])."""
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def summarize_list(rows: list[Any]) -> dict[str, Any]:
    """``{"count": n, "fields": {name: {min, p50, p90, p99, max, mean}}}`` over the numeric
    values of a list of numbers (field ``"value"``) or of flat dicts (each numeric field;
    ``None`` and non-numbers are skipped, and a field with none is left out)."""
    columns: dict[str, list[float]] = {}
    for row in rows:
        items = row.items() if isinstance(row, dict) else [("value", row)]
        for k, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                columns.setdefault(k, []).append(float(v))
    fields = {}
    for k, xs in columns.items():
        xs.sort()
        fields[k] = {
            "n": len(xs),
            "min": xs[0],
            "p50": _percentile(xs, 50),
            "p90": _percentile(xs, 90),
            "p99": _percentile(xs, 99),
            "max": xs[-1],
            "mean": round(sum(xs) / len(xs), 6),
        }
    return {"count": len(rows), "fields": fields}


def summarize(path: Path, keys: tuple[str, ...] = SAMPLE_KEYS) -> bool:
    """Rewrite ``path`` in place as described above; False (nothing written) when it has no
    raw list of ``MIN_SAMPLES`` or more under ``keys`` or is already a summary."""
    full = json.loads(path.read_text())
    if not isinstance(full, dict) or "raw_samples" in full:
        return False
    long = [k for k in keys if isinstance(full.get(k), list) and len(full[k]) >= MIN_SAMPLES]
    if not long:
        return False
    raw = path.with_name(path.name + ".gz")
    # mtime 0: the same input gives the same bytes, so a re-run shows no diff in git
    with gzip.GzipFile(raw, "wb", mtime=0) as f:
        f.write(json.dumps(full, separators=(",", ":")).encode())
    out: dict[str, Any] = {}
    for k, v in full.items():
        out[k] = summarize_list(v) if k in long else v
    out["raw_samples"] = {
        "file": raw.name,
        "keys": long,
        "note": f"{', '.join(long)}: summarized here; every sample is in {raw.name}",
    }
    path.write_text(json.dumps(out, indent=1) + "\n")
    return True


def load_full(path: Path) -> dict[str, Any]:
    """A result as it was written: the gzip'd original when ``path`` is a summary, else
    ``path`` itself."""
    data: dict[str, Any] = json.loads(path.read_text())
    if "raw_samples" in data:
        with gzip.open(path.with_name(data["raw_samples"]["file"])) as f:
            full: dict[str, Any] = json.loads(f.read())
        return full
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="result JSONs to rewrite in place")
    ap.add_argument(
        "--keys", default=",".join(SAMPLE_KEYS), help="top-level lists that are raw samples"
    )
    a = ap.parse_args(argv)
    keys = tuple(k for k in a.keys.split(",") if k)
    for p in a.paths:
        before = p.stat().st_size
        if summarize(p, keys):
            gz = p.with_name(p.name + ".gz")
            print(f"{p}: {before:,} → {p.stat().st_size:,} bytes (+ {gz.stat().st_size:,} gzip'd)")
        else:
            print(f"{p}: unchanged (no raw samples, or already a summary)")


if __name__ == "__main__":
    main()
