"""A coordinator's start and memory: the seconds from spawning ``corpusd serve`` to its serving
on loopback, and its resident memory (VmRSS, peak VmHWM) after it listed a stored corpus with
its head digest (the one corpus file it reads). Linux, CPU, the tiny default model.

    python -m tools.coordinator_footprint [--trials 3] [--out RESULT.json]

Each trial is a fresh store and coordinator; the report is the median and range of the trials.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.model.tiny import init_tiny
from corpusd.testing.holders import pin_sample


def measure(tmp: Path) -> dict[str, float]:
    cid = pin_sample(tmp, init_tiny(tmp / "model"), tokens=300)
    t0 = time.monotonic()
    co = start_coordinator(tmp / "coord", tmp / "store")
    started = time.monotonic() - t0
    try:

        async def listed() -> bool:
            async with CoordinatorClient(co.address) as cc:
                return any(c.corpus_id == cid for c in await cc.list_corpora(stored=True))

        assert asyncio.run(listed()), "the stored corpus was not listed"
        status = Path(f"/proc/{co.proc.pid}/status").read_text().splitlines()
        kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in status)
              if k in ("VmRSS", "VmHWM")}  # fmt: skip
    finally:
        co.stop()
    return {"start_s": round(started, 2), "rss_mb": kb["VmRSS"] // 1024,
            "peak_mb": kb["VmHWM"] // 1024}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3, help="fresh coordinators measured (>= 1)")
    ap.add_argument("--out", type=Path, help="write the trials and their summary as JSON here")
    a = ap.parse_args(argv)
    if a.trials < 1:
        ap.error("--trials must be >= 1")
    trials = []
    for _ in range(a.trials):
        with tempfile.TemporaryDirectory() as d:
            trials.append(measure(Path(d)))
    summary = {
        k: {"median": statistics.median(t[k] for t in trials),
            "min": min(t[k] for t in trials), "max": max(t[k] for t in trials)}
        for k in ("start_s", "rss_mb", "peak_mb")
    }  # fmt: skip
    s, r = summary["start_s"], summary["rss_mb"]
    print(f"coordinator, {a.trials} trials: serving {s['median']} s [{s['min']}–{s['max']}] after "
          f"spawn; {r['median']} MB [{r['min']}–{r['max']}] resident after listing a stored "
          "corpus")  # fmt: skip
    if a.out:
        import corpusd

        a.out.write_text(json.dumps({
            "command": "python -m tools.coordinator_footprint " + " ".join(argv or sys.argv[1:]),
            "corpusd": str(Path(corpusd.__file__).parent), "cpus": os.cpu_count(),
            "trials": trials, "summary": summary,
        }, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
