"""Placement simulation (NanoCP-style): KV-load imbalance and head-of-line wait per policy.

    python -m tools.bench_placement            # both traces, all policies (~20 s on 2 cores)
    python -m tools.bench_placement --quick    # fewer corpora (smoke run)

8 simulated holders of 14,000 frames (pages of 64 tokens: ~900k tokens, about what an 80 GB
GPU keeps of DeepSeek-V3.2's 61-layer latent + index cache). A seeded trace of corpus pins:
Poisson arrivals, exponential lifetimes, most corpora small (log-normal around 16k tokens) and
1 % or 5 % very large (400k–800k tokens). Every policy keeps one FIFO queue of pins that do not
fit; a pin's wait is the time from arrival to placement. Policies:

- ``waterfill-dcp``: the coordinator's ``placement.place`` — CP degree from the shipped length
  buckets, WaterFill over the least-loaded holders, admission by aggregate free frames;
- ``whole-least-loaded``: each corpus whole on the least-loaded holder that has room;
- ``fixed-cp-all``: each corpus split evenly over all 8 holders (fixed CP degree 8).

Imbalance is max/mean of the holders' used frames, averaged over the steady state: from two
mean lifetimes after the first arrival (the cluster has filled) to the last arrival.
Writes bench/results/placement-sim.json and, when matplotlib imports, placement-sim.png.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.placement import HolderLoad, NoFit, place

HOLDERS, CAPACITY, PAGE = 8, 14_000, 64
OUT = Path(__file__).resolve().parent.parent / "bench" / "results"

#: policy(loads, pages, tokens) → holder id → frames, or None when it does not fit now
Policy = Callable[[list[HolderLoad], int, int], dict[str, int] | None]


def waterfill_dcp(buckets: CpBuckets) -> Policy:
    def policy(loads: list[HolderLoad], pages: int, tokens: int) -> dict[str, int] | None:
        try:
            p = place(loads, pages, 1, buckets.degree(tokens))
        except NoFit:
            return None
        return {h: len(s) for h, s in p.shards.items()}

    return policy


def whole_least_loaded(loads: list[HolderLoad], pages: int, tokens: int) -> dict[str, int] | None:
    fit = [h for h in loads if h.free >= pages]
    if not fit:
        return None
    return {min(fit, key=lambda h: (h.used, h.holder_id)).holder_id: pages}


def fixed_cp_all(loads: list[HolderLoad], pages: int, tokens: int) -> dict[str, int] | None:
    order = sorted(loads, key=lambda h: (h.used, h.holder_id))
    share = {
        h.holder_id: pages // len(loads) + (i < pages % len(loads)) for i, h in enumerate(order)
    }
    if any(h.free < share[h.holder_id] for h in loads):
        return None
    return {h: n for h, n in share.items() if n}


@dataclass(frozen=True, slots=True)
class Pin:
    arrival: float
    tokens: int
    lifetime: float

    @property
    def pages(self) -> int:
        return -(-self.tokens // PAGE)


def trace(n: int, large_frac: float, seed: int, utilisation: float = 0.75) -> list[Pin]:
    """``n`` pins; the arrival rate is set so the expected resident load is ``utilisation``."""
    rng = random.Random(seed)
    sizes = [
        rng.randint(400_000, 800_000)
        if rng.random() < large_frac
        else int(min(max(rng.lognormvariate(math.log(16_000), 1.0), 2_000), 128_000))
        for _ in range(n)
    ]
    mean_pages = statistics.fmean(-(-t // PAGE) for t in sizes)
    lifetime = 100.0
    rate = utilisation * HOLDERS * CAPACITY / (mean_pages * lifetime)
    t, pins = 0.0, []
    for tokens in sizes:
        t += rng.expovariate(rate)
        pins.append(Pin(t, tokens, rng.expovariate(1 / lifetime)))
    return pins


@dataclass(frozen=True, slots=True)
class Result:
    large_frac: float
    policy: str
    imbalance_mean: float  # time-averaged max/mean of holders' used frames, steady state
    wait_mean: float  # arrival → placement, time units
    wait_p99: float
    wait_max: float
    waited_frac: float  # pins that could not be placed on arrival
    cp_degree_mean: float  # holders per corpus
    utilisation: float  # time-averaged used / capacity, steady state
    series: tuple[tuple[float, float], ...]  # (time, imbalance), thinned, for the plot


def simulate(
    pins: list[Pin], policy: Policy, large_frac: float, name: str, warmup: float = 200.0
) -> Result:
    used = {f"h{i}": 0 for i in range(HOLDERS)}
    events: list[tuple[float, int, int]] = [(p.arrival, 1, i) for i, p in enumerate(pins)]
    heapq.heapify(events)  # (time, 0 = departure first, 1 = arrival, pin index)
    queue: deque[int] = deque()
    held: dict[int, dict[str, int]] = {}
    waits, degrees = [0.0] * len(pins), []
    series: list[tuple[float, float]] = []
    area = span = util_area = 0.0
    last, start, end = 0.0, pins[0].arrival + warmup, pins[-1].arrival
    while events:
        now, kind, i = heapq.heappop(events)
        mean = sum(used.values()) / HOLDERS
        dt = max(0.0, min(now, end) - max(last, start))  # the part of [last, now] in the window
        if mean > 0:
            area += dt * max(used.values()) / mean
            span += dt
        util_area += dt * mean / CAPACITY
        last = now
        if kind == 0:
            for h, n in held.pop(i).items():
                used[h] -= n
        else:
            queue.append(i)
        while queue:  # strict FIFO: the head waits, and so does everyone behind it
            head = pins[queue[0]]
            loads = [HolderLoad(h, CAPACITY, u) for h, u in used.items()]
            got = policy(loads, head.pages, head.tokens)
            if got is None:
                break
            j = queue.popleft()
            for h, n in got.items():
                used[h] += n
                assert used[h] <= CAPACITY, f"{h} over capacity"
            held[j], waits[j] = got, now - head.arrival
            degrees.append(len(got))
            heapq.heappush(events, (now + head.lifetime, 0, j))
        mean = sum(used.values()) / HOLDERS
        series.append((now, max(used.values()) / mean if mean else 1.0))
    waits.sort()
    return Result(
        large_frac,
        name,
        imbalance_mean=area / span,
        wait_mean=statistics.fmean(waits),
        wait_p99=waits[int(0.99 * (len(waits) - 1))],
        wait_max=waits[-1],
        waited_frac=sum(w > 0 for w in waits) / len(waits),
        cp_degree_mean=statistics.fmean(degrees),
        utilisation=util_area / (end - start),
        series=tuple(series[:: max(1, len(series) // 400)]),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="600 pins instead of 4000")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    n = 600 if a.quick else 4000
    policies: dict[str, Policy] = {
        "waterfill-dcp": waterfill_dcp(CpBuckets.load()),
        "whole-least-loaded": whole_least_loaded,
        "fixed-cp-all": fixed_cp_all,
    }
    rows = []
    print(f"{HOLDERS} holders × {CAPACITY} frames, {n} pins, seed {a.seed}, target load 75 %")
    print(
        f"{'trace':<9} {'policy':<19} {'imbalance':>9} {'wait mean':>9} {'wait p99':>9} "
        f"{'wait max':>9} {'waited':>7} {'cp':>5} {'util':>5}"
    )
    for large in (0.01, 0.05):
        pins = trace(n, large, a.seed)
        for name, policy in policies.items():
            r = simulate(pins, policy, large, name)
            rows.append(r)
            print(
                f"{f'{large:.0%} large':<9} {name:<19} {r.imbalance_mean:>9.3f} "
                f"{r.wait_mean:>9.2f} {r.wait_p99:>9.1f} {r.wait_max:>9.1f} "
                f"{r.waited_frac:>7.1%} {r.cp_degree_mean:>5.2f} {r.utilisation:>5.0%}"
            )
    print("waits in time units (mean corpus lifetime = 100); cp = holders per corpus")
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {
        "about": __doc__.split("\n\n")[0],
        "config": {"holders": HOLDERS, "capacity_frames": CAPACITY, "page": PAGE, "pins": n,
                   "seed": a.seed, "cp_buckets": asdict(CpBuckets.load())["bounds"],
                   "mean_lifetime": 100.0, "target_utilisation": 0.75},
        "rows": [{k: v for k, v in asdict(r).items() if k != "series"} for r in rows],
    }  # fmt: skip
    (OUT / "placement-sim.json").write_text(json.dumps(doc, indent=2) + "\n")
    _plot(rows)
    print(f"wrote {OUT / 'placement-sim.json'}")
    return 0


def _plot(rows: list[Result]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in rows:
        if r.large_frac == 0.05:
            axes[0].plot([t for t, _ in r.series], [v for _, v in r.series], label=r.policy, lw=0.9)
    axes[0].set(xlabel="time (mean lifetime 100)", ylabel="KV load max/mean", ylim=(0.95, 3))
    axes[0].set_title("imbalance over time, 5 % large")
    axes[0].legend()
    names = sorted({r.policy for r in rows})
    for k, large in enumerate((0.01, 0.05)):
        mean = {r.policy: r.wait_mean for r in rows if r.large_frac == large}
        vals = [mean[p] for p in names]
        axes[1].bar([x + 0.4 * k for x in range(len(names))], vals, 0.4, label=f"{large:.0%} large")
    axes[1].set_xticks([x + 0.2 for x in range(len(names))], names)
    axes[1].set(ylabel="mean head-of-line wait", title="wait from arrival to placement")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(OUT / "placement-sim.png", dpi=120)
    print(f"wrote {OUT / 'placement-sim.png'}")


if __name__ == "__main__":
    sys.exit(main())
