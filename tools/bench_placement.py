"""Placement simulation (NanoCP-style): KV-load imbalance and head-of-line wait per policy.

    python -m tools.bench_placement            # both traces, all policies (~20 s on 2 cores)
    python -m tools.bench_placement --quick    # fewer corpora (smoke run)
    python -m tools.bench_placement --holders 64,512 --policies waterfill-dcp \
        --out bench/results/placement-scale.json          # the control plane at scale, on paper

8 (``--holders``) simulated holders of 14,000 frames (pages of 64 tokens: ~900k tokens, about
what an 80 GB GPU keeps of DeepSeek-V3.2's 61-layer latent + index cache). A seeded trace of
corpus pins: Poisson arrivals, exponential lifetimes, most corpora small (log-normal around 16k
tokens) and 1 % or 5 % very large (400k–800k tokens). Every policy keeps one FIFO queue of pins
that do not fit; a pin's wait is the time from arrival to placement. Policies:

- ``waterfill-dcp``: the coordinator's ``placement.place`` — CP degree from the shipped length
  buckets, WaterFill over the least-loaded holders, admission by aggregate free frames;
- ``whole-least-loaded``: each corpus whole on the least-loaded holder that has room;
- ``fixed-cp-all``: each corpus split evenly over all 8 holders (fixed CP degree 8).

Imbalance is max/mean of the holders' used frames, averaged over the steady state: from two
mean lifetimes after the first arrival (the cluster has filled) to the last arrival.

Each placement is timed (the policy call, measured here), and its publish latency is modelled as
that time plus the state's commit of the pin (``pinning`` row + page table, one etcd transaction):
``--etcd-commit-ms`` when given, else the measured loopback p50 of a 3-member etcd in
``bench/results/state-backends-cpu.json`` interpolated in pages (``bench_control_scale.commit_ms``;
measured with 2 replicas a page, so an upper bound for these 1-replica pins). The holders'
Assign (loading the pages) is not in it. Past 8 holders the trace grows with the cluster
(``--pins``, default: five mean lifetimes of arrivals, the first four a warm-up: a cluster fills
to 1 - e^-t of its steady load by t lifetimes).
Writes ``--out`` (default bench/results/placement-sim.json) and, for one cluster size when
matplotlib imports, a plot beside it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.placement import HolderLoad, NoFit, place
from tools.bench_control_scale import commit_ms

HOLDERS, CAPACITY, PAGE = 8, 14_000, 64
OUT = Path(__file__).resolve().parent.parent / "bench" / "results"
LIFETIME = 100.0

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


def trace(
    n: int, large_frac: float, seed: int, utilisation: float = 0.75, holders: int = HOLDERS
) -> list[Pin]:
    """``n`` pins; the arrival rate is set so the expected resident load of ``holders`` is
    ``utilisation``."""
    rng = random.Random(seed)
    sizes = [
        rng.randint(400_000, 800_000)
        if rng.random() < large_frac
        else int(min(max(rng.lognormvariate(math.log(16_000), 1.0), 2_000), 128_000))
        for _ in range(n)
    ]
    mean_pages = statistics.fmean(-(-t // PAGE) for t in sizes)
    lifetime = LIFETIME
    rate = utilisation * holders * CAPACITY / (mean_pages * lifetime)
    t, pins = 0.0, []
    for tokens in sizes:
        t += rng.expovariate(rate)
        pins.append(Pin(t, tokens, rng.expovariate(1 / lifetime)))
    return pins


def lifetimes_of_pins(lifetimes: float, large_frac: float, seed: int, holders: int) -> int:
    """How many pins of the trace arrive in ``lifetimes`` mean lifetimes."""
    mean_pages = statistics.fmean(p.pages for p in trace(20_000, large_frac, seed))
    return math.ceil(lifetimes * 0.75 * holders * CAPACITY / mean_pages)


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
    holders: int = HOLDERS
    place_ms_p50: float = 0.0  # the policy call that placed a pin, measured
    place_ms_p99: float = 0.0
    publish_ms_p50: float = 0.0  # placement + the modelled commit of the pin's page table
    publish_ms_p99: float = 0.0


def simulate(
    pins: list[Pin],
    policy: Policy,
    large_frac: float,
    name: str,
    warmup: float = 200.0,
    holders: int = HOLDERS,
    commit: Callable[[int], float] = lambda pages: 0.0,
) -> Result:
    """Run the trace through ``policy`` on ``holders`` holders; ``commit(pages)``: the modelled
    state commit of a pin of that many pages, ms."""
    used = {f"h{i}": 0 for i in range(holders)}
    placed_ms: list[float] = []
    publish_ms: list[float] = []
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
        mean = sum(used.values()) / holders
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
            t0 = time.perf_counter()
            got = policy(loads, head.pages, head.tokens)
            if got is None:
                break
            placed_ms.append((time.perf_counter() - t0) * 1e3)
            publish_ms.append(placed_ms[-1] + commit(head.pages))
            j = queue.popleft()
            for h, n in got.items():
                used[h] += n
                assert used[h] <= CAPACITY, f"{h} over capacity"
            held[j], waits[j] = got, now - head.arrival
            degrees.append(len(got))
            heapq.heappush(events, (now + head.lifetime, 0, j))
        mean = sum(used.values()) / holders
        series.append((now, max(used.values()) / mean if mean else 1.0))
    waits.sort()
    placed_ms.sort()
    publish_ms.sort()
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
        holders=holders,
        place_ms_p50=placed_ms[len(placed_ms) // 2],
        place_ms_p99=placed_ms[int(0.99 * (len(placed_ms) - 1))],
        publish_ms_p50=publish_ms[len(publish_ms) // 2],
        publish_ms_p99=publish_ms[int(0.99 * (len(publish_ms) - 1))],
    )


def _sizes(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated holder counts") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every holder count must be >= 1")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="600 pins instead of 4000 (8 holders)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holders", type=_sizes, default=[HOLDERS], help="e.g. 64,512")
    ap.add_argument(
        "--pins",
        type=int,
        default=0,
        help="pins per trace; 0: 4000 at 8 holders, else three lifetimes of arrivals",
    )
    ap.add_argument("--policies", default="all", help="comma-separated, or all")
    ap.add_argument(
        "--etcd-commit-ms",
        type=float,
        default=None,
        help="a pin's commit, ms (default: state-backends-cpu.json's etcd-3 p50)",
    )
    ap.add_argument("--out", default=str(OUT / "placement-sim.json"))
    a = ap.parse_args(argv)
    every: dict[str, Policy] = {
        "waterfill-dcp": waterfill_dcp(CpBuckets.load()),
        "whole-least-loaded": whole_least_loaded,
        "fixed-cp-all": fixed_cp_all,
    }
    names = list(every) if a.policies == "all" else a.policies.split(",")
    if unknown := [x for x in names if x not in every]:
        ap.error(f"--policies: {unknown} unknown; choose from {list(every)} or all")
    if a.etcd_commit_ms is not None and not (math.isfinite(a.etcd_commit_ms) and
                                             a.etcd_commit_ms >= 0):  # fmt: skip
        ap.error(f"--etcd-commit-ms {a.etcd_commit_ms}: must be a finite number >= 0")
    if a.pins < 0:
        ap.error(f"--pins {a.pins}: must be >= 0")
    if a.etcd_commit_ms is None:
        measured = json.loads((OUT / "state-backends-cpu.json").read_text())["results"]["etcd-3"]
        commit_model = "etcd-3 publish p50 from state-backends-cpu.json, linear in pages"

        def commit(pages: int) -> float:
            return commit_ms(measured, pages, "publish")
    else:
        commit_model = f"a constant {a.etcd_commit_ms:g} ms (--etcd-commit-ms)"

        def commit(pages: int) -> float:
            return float(a.etcd_commit_ms)

    rows = []
    print(f"{CAPACITY} frames a holder, seed {a.seed}, target load 75 %; commit: {commit_model}")
    print(
        f"{'holders':>7} {'trace':<9} {'policy':<19} {'pins':>6} {'imbalance':>9} {'wait mean':>9} "
        f"{'wait p99':>9} {'waited':>7} {'cp':>5} {'util':>5} {'place ms':>13} {'publish ms':>13}"
    )
    pins_used: dict[str, int] = {}
    for holders in a.holders:
        for large in (0.01, 0.05):
            n, warmup = a.pins or (600 if a.quick else 4000), 2 * LIFETIME
            if not a.pins and holders != HOLDERS:
                n, warmup = lifetimes_of_pins(5, large, a.seed, holders), 4 * LIFETIME
            pins_used[f"{holders} holders, {large:.0%} large"] = n
            pins = trace(n, large, a.seed, holders=holders)
            for name in names:
                r = simulate(pins, every[name], large, name, warmup, holders, commit)
                rows.append(r)
                print(
                    f"{holders:>7} {f'{large:.0%} large':<9} {name:<19} {n:>6} "
                    f"{r.imbalance_mean:>9.3f} {r.wait_mean:>9.2f} {r.wait_p99:>9.1f} "
                    f"{r.waited_frac:>7.1%} {r.cp_degree_mean:>5.2f} {r.utilisation:>5.0%} "
                    f"{r.place_ms_p50:>6.2f}/{r.place_ms_p99:<6.2f} "
                    f"{r.publish_ms_p50:>6.1f}/{r.publish_ms_p99:<6.1f}",
                    flush=True,
                )
    print("waits in time units (mean corpus lifetime = 100); cp = holders per corpus; "
          "place / publish: p50/p99 per placed pin")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "about": __doc__.split("\n\n")[0],
        "command": "python -m tools.bench_placement "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"holders": a.holders, "capacity_frames": CAPACITY, "page": PAGE,
                   "pins": pins_used, "seed": a.seed,
                   "cp_buckets": asdict(CpBuckets.load())["bounds"],
                   "mean_lifetime": LIFETIME, "target_utilisation": 0.75,
                   "commit_model": commit_model,
                   "publish": "measured placement + modelled commit; holders' Assign not in it"},
        "rows": [{k: v for k, v in asdict(r).items() if k != "series"} for r in rows],
    }  # fmt: skip
    out.write_text(json.dumps(doc, indent=2) + "\n")
    if len(a.holders) == 1 and len(names) == len(every):
        _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def _plot(rows: list[Result], path: Path) -> None:
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
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
