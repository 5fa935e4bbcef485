"""A decode step's time by batch size, read from an SGLang server's log.

SGLang logs a ``Decode batch`` line every ``--decode-log-interval`` steps (40 by default) with
the running requests and the generation throughput over the interval. At a steady batch of
``b`` requests, a step takes ``b / throughput``. This prints, per batch size seen at least
``--min-lines`` times, the number of lines, the median throughput and the step time it implies:

    python -m tools.decode_log_steps bench/results/logs/share-h200x4-n4-spread-0.5-route-worker0.log

Lines where the batch changed within the interval mix sizes; batch sizes seen only once or
twice are mostly those, hence the threshold. A reading of a log, not a trial figure.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(
    r"Decode batch, #running-req: (\d+),.*?gen throughput \(token/s\): ([\d.]+)"
)  # fmt: skip


def steps(text: str, min_lines: int = 3) -> dict[int, dict[str, float]]:
    """Per batch size: ``lines``, median ``tok_s`` and the ``step_ms`` it implies."""
    by: dict[int, list[float]] = {}
    for m in LINE.finditer(text):
        by.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    out = {}
    for b, xs in sorted(by.items()):
        tok_s = statistics.median(xs)
        if len(xs) >= min_lines and tok_s > 0:
            out[b] = {"lines": len(xs), "tok_s": round(tok_s, 1),
                      "step_ms": round(1e3 * b / tok_s, 2)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("logs", nargs="+", help="SGLang server logs")
    ap.add_argument("--min-lines", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object, log → batch → figures")
    a = ap.parse_args(argv)
    got = {p: steps(Path(p).read_text(errors="replace"), a.min_lines) for p in a.logs}
    if a.json:
        json.dump(got, sys.stdout, indent=1)
        print()
        return 0
    for p, rows in got.items():
        print(p)
        for b, r in rows.items():
            print(f"  batch {b:>4}: {r['lines']:>3} lines, {r['tok_s']:>9,.0f} tok/s, "
                  f"{r['step_ms']:>6.2f} ms a step")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
