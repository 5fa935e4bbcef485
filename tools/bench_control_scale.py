"""The control plane at 8, 64 and 512 holders, on paper: placement measured, commits modelled.

For each cluster size, holders of 14,000 frames (as tools/bench_placement.py) are filled to about
60 % by a seeded trace of pins placed with the coordinator's own ``placement.place`` (CP degree
from the shipped buckets); then a pin of 16k, 256k and 1M tokens is placed 20 times on that load
(median time) and its publish latency is modelled as placement + the state's commit of its page
table (pinning row + commit_pin), read from the measured ``bench/results/state-backends-cpu.json``
(p50, interpolated linearly in pages between its sizes) for SQLite and a 3-member etcd. The
holders' Assign (loading pages) is not in it. Imbalance is max/mean of used frames after the
fill. Heartbeat load: every holder beats every lease/3 (10 s lease), each one state write of the
measured heartbeat p50; the table gives the share of one core the leader spends on them.

    python -m tools.bench_control_scale
Writes bench/results/control-scale.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.placement import HolderLoad, NoFit, place

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
CAPACITY, PAGE, LEASE_S = 14_000, 64, 10.0


def commit_ms(rows: list[dict[str, dict[str, float]]], pages: int, what: str) -> float:
    """p50 of ``what`` at ``pages``, linear between the measured sizes (clamped past them)."""
    pts = sorted((int(r["pages"]), r[what]["p50_ms"]) for r in rows)  # type: ignore[call-overload]
    if pages <= pts[0][0]:
        return pts[0][1]
    for (p0, t0), (p1, t1) in itertools.pairwise(pts):
        if pages <= p1:
            return t0 + (t1 - t0) * (pages - p0) / (p1 - p0)
    (p0, t0), (p1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) * (pages - p1) / (p1 - p0)


def fill(n: int, buckets: CpBuckets, rng: random.Random) -> list[HolderLoad]:
    used = {f"h{i}": 0 for i in range(n)}
    target = 0.6 * n * CAPACITY
    while sum(used.values()) < target:
        tokens = int(rng.lognormvariate(9.7, 1.0)) + 1  # around 16k tokens
        pages = -(-tokens // PAGE)
        loads = [HolderLoad(h, CAPACITY, u) for h, u in used.items()]
        try:
            p = place(loads, pages, 1, buckets.degree(tokens))
        except NoFit:
            break
        for h, shard in p.shards.items():
            used[h] += len(shard)
    return [HolderLoad(h, CAPACITY, u) for h, u in used.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--holders", type=int, nargs="+", default=[8, 64, 512])
    a = ap.parse_args()
    measured = json.loads((RESULTS / "state-backends-cpu.json").read_text())["results"]
    buckets = CpBuckets.load("")
    rng = random.Random(21)
    out = []
    print(f"{'holders':>7} {'imbalance':>9} {'tokens':>9} {'cp':>3} {'place ms':>9} "
          f"{'pub sqlite ms':>13} {'pub etcd-3 ms':>13} {'hb share':>8}")  # fmt: skip
    for n in a.holders:
        loads = fill(n, buckets, rng)
        used = [x.used for x in loads]
        imbalance = max(used) / statistics.fmean(used)
        beats = n / (LEASE_S / 3)
        for tokens in (16_384, 262_144, 1_048_576):
            pages = tokens // PAGE
            times = []
            for _ in range(20):
                t = time.perf_counter()
                p = place(loads, pages, 1, buckets.degree(tokens))
                times.append((time.perf_counter() - t) * 1e3)
            t_place = statistics.median(times)
            row = {
                "holders": n,
                "imbalance_after_fill": round(imbalance, 4),
                "tokens": tokens,
                "cp_degree": p.cp_degree,
                "place_ms": round(t_place, 3),
                "publish_ms": {
                    b: round(t_place + commit_ms(measured[b], pages, "publish"), 2)
                    for b in ("sqlite", "etcd-3")
                    if b in measured
                },
                "heartbeats_per_s": round(beats, 1),
                "heartbeat_core_share": {
                    b: round(beats * commit_ms(measured[b], 16, "heartbeat") / 1e3, 3)
                    for b in ("sqlite", "etcd-3")
                    if b in measured
                },
            }
            out.append(row)
            pub, hb = row["publish_ms"], row["heartbeat_core_share"]
            print(f"{n:>7} {imbalance:>9.3f} {tokens:>9,} {p.cp_degree:>3} {t_place:>9.2f} "
                  f"{pub.get('sqlite', 0):>13.1f} {pub.get('etcd-3', 0):>13.1f} "
                  f"{hb.get('etcd-3', 0):>8.3f}")  # fmt: skip
    doc = {
        "command": "python -m tools.bench_control_scale",
        "model": "publish = measured place() + the state's commit p50 for the page count, from "
                 "state-backends-cpu.json (linear in pages); holders' Assign not included; "
                 "heartbeat share = holders / (lease/3) x measured heartbeat p50",
        "lease_s": LEASE_S,
        "rows": out,
    }  # fmt: skip
    path = RESULTS / "control-scale.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
