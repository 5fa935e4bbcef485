"""Publish and lookup latency of the coordinator's two state stores, on this machine.

SQLite (the embedded default: one WAL file, synchronous=FULL) against etcd on loopback — one
member, and a 3-member cluster (each commit is a raft round to a quorum, each fsynced). The
stores are driven in-process through their interface (``corpusd.coordinator.db``), as the
coordinator drives them, so the figures are the state's own cost without gRPC in front:

- publish: ``put_corpus`` (the ``pinning`` row) + ``commit_pin`` (the page table and the
  ``ready`` row in one transaction), for a corpus of P pages × 2 replicas;
- lookup: ``page_table`` of that corpus (what ``GetPageTable`` reads);
- heartbeat: a holder's lease renewal with its load.

    python -m tools.bench_state                      # 16, 256, 4096 pages; 40 rounds each
    python -m tools.bench_state --pages 256 --rounds 10
Writes bench/results/state-backends-cpu.json (needs the etcd binary for the etcd rows).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from corpusd.coordinator.db import CorpusRow, HolderRow, StateStore, open_state
from corpusd.coordinator.etcd_local import etcd_binary, start_etcd
from corpusd.coordinator.etcd_state import EtcdState

OUT = Path(__file__).resolve().parents[1] / "bench" / "results" / "state-backends-cpu.json"


async def timed(fn: Callable[[], Awaitable[object]], rounds: int) -> dict[str, float]:
    """p50 / p99 / mean of ``rounds`` calls, in milliseconds (after 3 warm-up calls)."""
    for _ in range(3):
        await fn()
    ms = []
    for _ in range(rounds):
        t = time.perf_counter()
        await fn()
        ms.append((time.perf_counter() - t) * 1e3)
    ms.sort()
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def lead(state: EtcdState) -> None:
    """Take the leader key the way the election does, so the fenced writes go through."""
    c = state.client
    lease = await c.lease(30)
    await c.put(state.leader_key, b"bench", lease=lease)
    kv = await c.get(state.leader_key)
    assert kv is not None
    state.leader_rev = kv.create_revision


async def publish(
    state: StateStore,
    take: Callable[[Iterator[str]], str],
    ids: Iterator[str],
    pages: int,
    table: dict[tuple[int, int], tuple[str, int]],
) -> None:
    """One pin's writes: its ``pinning`` row, then its page table and ``ready`` row."""
    cid = take(ids)
    plan: dict[str, list[int]] = {h: [] for h, _ in table.values()}
    row = CorpusRow(cid, cid, "pinning", "{}", pages * 64, pages, 2, 0, plan, None, time.time())
    await state.put_corpus(row)
    await state.commit_pin(cid, table, 8)


async def measure(state: StateStore, pages_list: list[int], rounds: int) -> list[dict[str, object]]:
    holders = [f"h{i}" for i in range(8)]
    for h in holders:
        await state.register(
            HolderRow(h, f"127.0.0.1:{9000 + int(h[1:])}", "cpu", 1 << 20, 64, "fp", "float32",
                      0, 0, time.time(), 10.0),
            10.0,
        )  # fmt: skip
    rows = []
    for pages in pages_list:
        table = {(p, r): (holders[(p + r) % 8], p) for p in range(pages) for r in range(2)}
        ids = iter(f"c{pages}x{i}" for i in range(rounds + 3))
        pub = await timed(functools.partial(publish, state, next, ids, pages, table), rounds)
        last = f"c{pages}x{rounds + 2}"
        assert len(await state.page_table(last)) == pages
        look = await timed(functools.partial(state.page_table, last), rounds)
        beat = await timed(lambda: state.heartbeat("h0", 10, 1, time.time()), rounds)
        rows.append({"pages": pages, "publish": pub, "lookup": look, "heartbeat": beat})
    return rows


async def run_store(
    url: str, state_dir: Path, pages: list[int], rounds: int
) -> list[dict[str, object]]:
    state = open_state(url, state_dir, node="bench")
    try:
        if isinstance(state, EtcdState):
            await lead(state)
        return await measure(state, pages, rounds)
    finally:
        await state.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pages", type=int, nargs="+", default=[16, 256, 4096])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results["sqlite"] = asyncio.run(run_store("sqlite", root / "sqlite", a.pages, a.rounds))
        if etcd_binary() is None:
            print("no etcd binary: etcd rows skipped (apt-get install etcd-server)")
        else:
            for members in (1, 3):
                cluster = start_etcd(root / f"etcd{members}", members)
                try:
                    results[f"etcd-{members}"] = asyncio.run(
                        run_store(cluster.url("bench"), root, a.pages, a.rounds)
                    )
                finally:
                    cluster.stop()
    print(f"{'store':<8} {'pages':>6} {'publish p50':>12} {'p99':>8} {'lookup p50':>11} "
          f"{'p99':>8} {'heartbeat p50':>14}  (ms)")  # fmt: skip
    for store, rows in results.items():
        for r in rows:  # type: ignore[attr-defined]
            print(f"{store:<8} {r['pages']:>6} {r['publish']['p50_ms']:>12.2f} "
                  f"{r['publish']['p99_ms']:>8.2f} {r['lookup']['p50_ms']:>11.2f} "
                  f"{r['lookup']['p99_ms']:>8.2f} {r['heartbeat']['p50_ms']:>14.2f}")  # fmt: skip
    etcd_version = ""
    if etcd_binary():
        etcd_version = subprocess.run(
            [str(etcd_binary()), "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0]
    doc = {
        "command": "python -m tools.bench_state " + " ".join(
            [f"--pages {' '.join(map(str, a.pages))}", f"--rounds {a.rounds}"]
        ),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "etcd": etcd_version, "load_average": os.getloadavg(),
                    "note": "shared 2-core machine (load average at the end), loopback, disk"},
        "what": "in-process StateStore calls; publish = put_corpus(pinning) + commit_pin "
                "(P pages x 2 replicas); lookup = page_table; heartbeat = lease renewal + load",
        "results": results,
    }  # fmt: skip
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
