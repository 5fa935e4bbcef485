"""A coordinator's start and memory: the seconds from spawning ``corpusd serve`` to its serving
on loopback, and its resident memory (VmRSS, peak VmHWM) after it listed a stored corpus with
its head digest (the one corpus file it reads). Linux, CPU, the tiny default model.

    python -m tools.coordinator_footprint
"""

from __future__ import annotations

import asyncio
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
    with tempfile.TemporaryDirectory() as d:
        m = measure(Path(d))
    print(f"coordinator: serving {m['start_s']} s after spawn; {m['rss_mb']} MB resident "
          f"({m['peak_mb']} MB peak) after listing a stored corpus")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
