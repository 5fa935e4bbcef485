"""Replicas that follow load (issue 21): one hot corpus driven past a real holder's fan-in elbow by
real Attend calls; the leader adds a replica, latency comes back, the load stops, the replica goes.

    python -m tools.bench_fanin --out bench/results/fanin-replicas-cpu.json

Starts a coordinator (SQLite, ``--lease-s 3``: a heartbeat a second, ``--replica-window-s``),
``--holders`` holders (``--max-flows``: the elbow each reports, ``--threads 1``: a flow is one
core), and pins a synthetic corpus whole on one holder (1 replica). Requests arrive open-loop at a
fixed rate (Poisson), each an Attend of ``--rows`` query rows over ``--k`` random corpus positions
at layer 0, routed the way a requester routes them: the page table's ``CorpusView`` (page ``p`` →
replica ``p mod n``), one ``Attend`` per holder, LSE-merged. Agent workers re-read a bound
corpus's page table only on bind or failover, so this requester re-reads it every
``--refresh-s`` (the periodic re-read the workers lack; 0: read once, as a bound worker does).

Phases: ``baseline`` (``--low`` × what one holder completes saturated, measured first),
``overload`` (``--high`` ×) until the page table shows the replica, ``continued`` (the same
rate, ``--continued-s``), ``idle`` (no load) until the replica is removed. Per second:
completed requests, latency p50/p99, refusals, each holder's fan-in (flows running + queued,
from its ``/metrics``), replicas in the page table and in the requester's view.
Prints a table, writes JSON and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient, PageTable
from corpusd.coordinator.launch import start_coordinator
from corpusd.model import ModelConfig
from corpusd.model.tiny import init_tiny
from holder.launch import HolderProcess
from requester.corpus_view import CorpusView
from requester.holder_client import HolderClient
from requester.plan import holder_groups, merge_groups
from tests.support.coordinators import start_holders, synthetic_corpus

REPLICAS = "corpusd_coordinator_load_replicas_total"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text: str = r.read().decode()
    return text


def metric(text: str, key: str) -> float:
    """The first sample of ``key`` (a name, or a name with its labels as exposed)."""
    for ln in text.splitlines():
        if ln.startswith(key + " ") or ("{" not in key and ln.startswith(key + "{")):
            return float(ln.split()[-1])
    return 0.0


@dataclass
class Run:
    t0: float
    wall0: float = field(default_factory=time.time)
    done: list[tuple[float, float]] = field(default_factory=list)  # (completed at s, latency s)
    refused: list[float] = field(default_factory=list)  # completed at s (RESOURCE_EXHAUSTED ...)
    errors: list[str] = field(default_factory=list)
    stale: list[float] = field(default_factory=list)  # NOT_FOUND from a released copy, retried
    samples: list[dict[str, Any]] = field(default_factory=list)  # fan-in / replicas, 0.5 s
    events: list[dict[str, Any]] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, start s)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, what: str, **kw: Any) -> None:
        self.events.append({"t_s": round(self.now(), 2), "event": what, **kw})
        print(f"[{self.now():6.1f} s] {what} {kw if kw else ''}", flush=True)


class Requester:
    """Routes Attend calls by the page table's view, re-read every ``refresh_s``."""

    def __init__(self, cc: CoordinatorClient, table: PageTable, scale: float, d_v: int) -> None:
        self.cc, self.scale, self.d_v = cc, scale, d_v
        self.cid = table.corpus.corpus_id
        self.view = CorpusView.from_page_table(table)
        self.clients: dict[str, HolderClient] = {}
        self.compute_s = 0.0  # the last call's longest holder compute

    def client(self, address: str) -> HolderClient:
        if address not in self.clients:
            self.clients[address] = HolderClient(address)
        return self.clients[address]

    async def refresh(self) -> int:
        """Re-read the page table; returns the most replicas any page has."""
        table = await self.cc.page_table(self.cid)
        self.view = CorpusView.from_page_table(table)
        return max(len(r) for r in table.pages)

    async def attend(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The requester's plan: positions grouped by the holder of their page, compacted (each
        holder gets only its own rows), one Attend per holder, the exact merge."""
        groups = holder_groups(self.view, positions)
        parts = await asyncio.gather(
            *(
                self.client(g.address).attend_rows(self.cid, 0, q[g.keep], g.rows, self.scale)
                for g in groups
            )
        )
        self.compute_s = max(p.compute_us for p in parts) / 1e6
        return merge_groups(q, self.d_v, groups, [(p.o, p.lse) for p in parts])[0]

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()


async def drive(
    a: argparse.Namespace,
    co_address: str,
    co_metrics: int,
    holders: list[HolderProcess],
    cid: str,
    scale: float,
    heads: int,
    width: int,
    d_v: int,
    tokens: int,
) -> tuple[Run, dict[str, Any]]:
    g = torch.Generator().manual_seed(a.seed)
    rng = random.Random(a.seed)
    k = min(a.k, tokens)
    pool = [
        (
            torch.randn(a.rows, heads, width, generator=g),
            torch.stack([torch.randperm(tokens, generator=g)[:k] for _ in range(a.rows)]),
        )
        for _ in range(16)
    ]
    async with CoordinatorClient(co_address) as cc:
        await cc.wait_holders(len(holders))
        table = await cc.pin(cid)
        (hot,) = table.holders
        port_of = {h.address: h.metrics_port for h in holders}
        hid_port = {hid: port_of[table.address(hid)] for hid in table.holders}
        for info in await cc.list_holders():
            hid_port[info.info.holder_id] = port_of[info.info.address]
        req = Requester(cc, table, scale, d_v)
        # one holder's capacity: serial calls on the hot holder (the only one the table names)
        for q, pos in pool[:3]:
            await req.attend(q, pos)
        ts, cs = [], []
        for q, pos in pool[3:13]:
            t = time.perf_counter()
            await req.attend(q, pos)
            ts.append(time.perf_counter() - t)
            cs.append(req.compute_s)
        service_s, compute_s = pct(ts, 0.5), pct(cs, 0.5)
        # requests/s one holder completes when saturated, measured (on a shared machine the
        # serial compute time says little about it): 4 closed loops for --calibrate-s
        end, n_sat = time.perf_counter() + a.calibrate_s, 0

        async def loop(i: int) -> None:
            nonlocal n_sat
            while time.perf_counter() < end:
                q, pos = pool[(i + n_sat) % len(pool)]
                await req.attend(q, pos)
                n_sat += 1

        t_sat = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(4)))
        capacity = n_sat / (time.perf_counter() - t_sat)
        meta = {
            "hot_holder": hot,
            "serial_latency_ms": round(service_s * 1e3, 2),
            "serial_holder_compute_ms": round(compute_s * 1e3, 2),
            "one_holder_saturated_rps": round(capacity, 2),
            "rates_rps": {
                "baseline": round(a.low * capacity, 2),
                "overload": round(a.high * capacity, 2),
            },
        }
        print(
            f"serial Attend {service_s * 1e3:.1f} ms (holder compute {compute_s * 1e3:.1f} ms) "
            f"on {hot}; saturated, one holder completes {capacity:.2f} req/s"
        )
        run = Run(time.perf_counter())
        rate = 0.0
        stop = asyncio.Event()
        inflight: set[asyncio.Task[None]] = set()

        async def one() -> None:
            q, pos = pool[rng.randrange(len(pool))]
            t = time.perf_counter()
            try:
                try:
                    await req.attend(q, pos)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    # a view older than a removal: the copy was released. Re-read and retry
                    # once, as the fan-out's failover does
                    run.stale.append(run.now())
                    await req.refresh()
                    await req.attend(q, pos)
                run.done.append((run.now(), time.perf_counter() - t))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    run.refused.append(run.now())
                else:
                    run.errors.append(f"{e.code().name}: {e.details()}")

        async def arrivals() -> None:
            while not stop.is_set():
                if rate <= 0:
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.sleep(rng.expovariate(rate))
                if rate > 0:
                    task = asyncio.create_task(one())
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)

        replicas = {"table": 1, "seen_by_requester": 1}
        last_refresh = 0.0

        async def watch() -> None:
            nonlocal last_refresh
            while not stop.is_set():
                s: dict[str, Any] = {"t_s": round(run.now(), 2), "fanin": {}}
                for hid, port in hid_port.items():
                    try:
                        text = await asyncio.to_thread(scrape, port)
                    except OSError:
                        continue
                    fanin = metric(text, "corpusd_holder_flows_active") + metric(
                        text, "corpusd_holder_queue_depth"
                    )
                    s["fanin"][hid] = int(fanin)
                t = await cc.page_table(cid)
                n = max(len(r) for r in t.pages)
                if n != replicas["table"]:
                    added = [p for p, r in enumerate(t.pages) if len(r) > 1]
                    run.event("page table: replicas", replicas=n, pages_with_two=len(added))
                    replicas["table"] = n
                s["replicas"] = n
                text = await asyncio.to_thread(scrape, co_metrics)
                for action in ("added", "removed"):
                    s[f"coordinator_{action}"] = metric(text, f'{REPLICAS}{{action="{action}"}}')
                if a.refresh_s and run.now() - last_refresh >= a.refresh_s:
                    last_refresh = run.now()
                    seen = await req.refresh()
                    if seen != replicas["seen_by_requester"]:
                        run.event("requester re-read the page table", replicas=seen)
                        replicas["seen_by_requester"] = seen
                s["requester_replicas"] = replicas["seen_by_requester"]
                run.samples.append(s)
                await asyncio.sleep(0.5)

        tasks = [asyncio.create_task(arrivals()), asyncio.create_task(watch())]

        def phase(name: str, r: float) -> None:
            nonlocal rate
            rate = r
            run.phases.append((name, round(run.now(), 2)))
            run.event(f"phase {name}", rate_rps=round(r, 2))

        async def until(cond: Any, limit_s: float) -> bool:
            end = time.perf_counter() + limit_s
            while time.perf_counter() < end:
                if cond():
                    return True
                await asyncio.sleep(0.2)
            return False

        # saturating one holder to measure it may itself earn a replica: wait until it is gone
        await asyncio.sleep(1.5)
        if replicas["table"] > 1:
            run.event("replica from the calibration; waiting for its removal")
            await until(lambda: replicas["table"] == 1 and replicas["seen_by_requester"] == 1,
                        a.max_wait_s)  # fmt: skip
        phase("baseline", a.low * capacity)
        await asyncio.sleep(a.baseline_s)
        phase("overload", a.high * capacity)
        if not await until(lambda: replicas["table"] > 1, a.max_wait_s):
            run.event("no replica within --max-wait-s")
        phase("continued", a.high * capacity)
        await asyncio.sleep(a.continued_s)
        phase("idle", 0.0)
        if not await until(lambda: replicas["table"] == 1, a.max_wait_s):
            run.event("replica not removed within --max-wait-s")
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*tasks, *inflight)
        await req.close()
    return run, meta


def per_second(run: Run) -> list[dict[str, Any]]:
    end = int(max([t for t, _ in run.done] + [s["t_s"] for s in run.samples])) + 1
    rows = []
    for sec in range(end):
        lat = [x for t, x in run.done if sec <= t < sec + 1]
        smp = [s for s in run.samples if sec <= s["t_s"] < sec + 1]
        name = [n for n, t in run.phases if t <= sec + 0.5]
        fanin: dict[str, int] = {}
        for s in smp:
            for h, f in s["fanin"].items():
                fanin[h] = max(fanin.get(h, 0), f)
        rows.append(
            {
                "t_s": sec,
                "phase": name[-1] if name else "",
                "done": len(lat),
                "refused": sum(sec <= t < sec + 1 for t in run.refused),
                "p50_ms": round(pct(lat, 0.5) * 1e3, 1) if lat else None,
                "p99_ms": round(pct(lat, 0.99) * 1e3, 1) if lat else None,
                "fanin_max": fanin,
                "replicas": max((s["replicas"] for s in smp), default=None),
                "requester_replicas": max((s["requester_replicas"] for s in smp), default=None),
            }
        )
    return rows


def phase_stats(run: Run, settle_s: float) -> dict[str, Any]:
    bounds = [*run.phases, ("end", run.now())]
    out: dict[str, Any] = {}
    for (name, t0), (_, t1) in itertools.pairwise(bounds):
        lat = [x for t, x in run.done if t0 <= t < t1]
        out[name] = {
            "from_s": t0,
            "to_s": round(t1, 2),
            "done": len(lat),
            "refused": sum(t0 <= t < t1 for t in run.refused),
            "p50_ms": round(pct(lat, 0.5) * 1e3, 1),
            "p99_ms": round(pct(lat, 0.99) * 1e3, 1),
        }
    c0, c1 = next(
        ((t0, t1) for (n, t0), (_, t1) in itertools.pairwise(bounds) if n == "continued"),
        (0.0, 0.0),
    )
    late = [x for t, x in run.done if c0 + settle_s <= t < c1]
    out["continued_after_settle"] = {
        "from_s": round(c0 + settle_s, 2),
        "to_s": round(c1, 2),
        "done": len(late),
        "p50_ms": round(pct(late, 0.5) * 1e3, 1),
        "p99_ms": round(pct(late, 0.99) * 1e3, 1),
    }
    # requests that started and ended while the requester's view had the replica, under load
    spans, since = [], None
    for e in run.events:
        if e["event"].startswith("requester re-read"):
            if e["replicas"] > 1 and since is None:
                since = e["t_s"]
            elif e["replicas"] == 1 and since is not None:
                spans.append((since, e["t_s"]))
                since = None
    if since is not None:
        spans.append((since, run.now()))
    idle = next((t for n, t in run.phases if n == "idle"), run.now())
    used = [x for t, x in run.done if t < idle and any(a <= t - x and t <= b for a, b in spans)]
    out["with_replica_under_load"] = {
        "spans_s": [[round(a, 2), round(b, 2)] for a, b in spans],
        "done": len(used),
        "p50_ms": round(pct(used, 0.5) * 1e3, 1),
        "p99_ms": round(pct(used, 0.99) * 1e3, 1),
    }
    return out


def actions(log: str, run: Run) -> list[dict[str, Any]]:
    """The coordinator's ``load replica added/removed`` lines, on the run's clock (its log
    stamps local time to the millisecond)."""
    out = []
    for ln in log.splitlines():
        m = re.match(r"(\S+ \S+),(\d+) .*load replica (added|removed)", ln)
        if m:
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            out.append({"t_s": round(at - run.wall0, 2), "action": m.group(3)})
    return out


def plot(
    rows: list[dict[str, Any]], run: Run, acts: list[dict[str, Any]], hot: str, path: Path,
    title: str,
) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    t = [r["t_s"] + 0.5 for r in rows]
    ax.plot(t, [r["p50_ms"] for r in rows], label="p50", color="C0")
    ax.plot(t, [r["p99_ms"] for r in rows], label="p99", color="C1", alpha=0.6)
    ax.set_yscale("log")
    ax.set_ylabel("Attend latency per second (ms)")
    hs = sorted({h for s in run.samples for h in s["fanin"]})
    for i, h in enumerate(hs):
        bx.step(
            [s["t_s"] for s in run.samples],
            [s["fanin"].get(h, 0) for s in run.samples],
            where="post",
            label=f"{h}{' (hot)' if h == hot else ''}",
            color=f"C{i + 2}",
        )
    bx.set_ylabel("fan-in (flows + queued)")
    bx.set_xlabel("seconds")
    for x in (ax, bx):
        for name, t0 in run.phases:
            x.axvline(t0, color="grey", ls=":", lw=1)
            if x is ax:
                x.text(
                    t0, 1.0, f" {name}", transform=x.get_xaxis_transform(), fontsize=8, va="bottom"
                )
        for e in acts:
            x.axvline(e["t_s"], color="red" if e["action"] == "added" else "black", lw=1.2)
    ax.plot([], [], color="red", label="replica added (coordinator log)")
    ax.plot([], [], color="black", label="replica removed")
    ax.legend(fontsize=8, loc="upper left")
    bx.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench/results/fanin-replicas-cpu.json")
    p.add_argument("--plot", default="", help="default: --out with .png")
    p.add_argument("--holders", type=int, default=2)
    p.add_argument("--max-flows", type=int, default=1, help="each holder's elbow (--max-flows)")
    p.add_argument("--tokens", type=int, default=4096, help="corpus tokens (64-token pages)")
    p.add_argument("--rows", type=int, default=8, help="query rows per Attend")
    p.add_argument("--k", type=int, default=4096, help="corpus positions per query row")
    p.add_argument("--low", type=float, default=0.3, help="baseline rate × one holder's capacity")
    p.add_argument("--high", type=float, default=1.15, help="overload rate × one holder's capacity")
    p.add_argument("--window-s", type=float, default=5.0, help="coordinator --replica-window-s")
    p.add_argument("--baseline-s", type=float, default=15.0)
    p.add_argument("--continued-s", type=float, default=30.0)
    p.add_argument(
        "--settle-s",
        type=float,
        default=10.0,
        help="continued-phase seconds left out of the recovered p50 (queue drains)",
    )
    p.add_argument("--max-wait-s", type=float, default=90.0)
    p.add_argument(
        "--refresh-s",
        type=float,
        default=1.0,
        help="the requester re-reads the page table this often (0: never)",
    )
    p.add_argument("--calibrate-s", type=float, default=6.0, help="one holder saturated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="", help="keep the daemons' state and logs here")
    a = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="bench-fanin-")
    root = Path(a.work or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not (model / "config.json").exists():
        init_tiny(model)
    cfg = ModelConfig.from_dir(model)
    store = root / "store"
    cid = synthetic_corpus(store, model, a.tokens)
    profile = root / "profile.json"
    profile.write_text('{"cp_buckets": [[null, 1]]}')  # the whole corpus on one holder
    co = start_coordinator(
        root / "coord",
        store,
        "--profile",
        str(profile),
        "--lease-s",
        "3",
        "--replica-window-s",
        str(a.window_s),
    )
    cap = str(2 * a.tokens)
    flags = ("--capacity-tokens", cap, "--max-flows", str(a.max_flows), "--queue-timeout-s", "30")
    hs: list[HolderProcess] = []
    try:
        hs = start_holders(store, root, model, co.address, a.holders, *flags)
        run, meta = asyncio.run(
            drive(
                a,
                co.address,
                co.metrics_port,
                hs,
                cid,
                cfg.softmax_scale,
                cfg.num_attention_heads,
                cfg.kv_dim,
                cfg.kv_lora_rank,
                a.tokens,
            )
        )
        log = (root / "coord" / "coordinator.log").read_text()
    finally:
        codes = [h.stop() for h in hs] + [co.stop()]
    load = os.getloadavg()
    rows = per_second(run)
    stats = phase_stats(run, a.settle_s)
    base, rec = stats["baseline"]["p50_ms"], stats["continued_after_settle"]["p50_ms"]
    used = stats["with_replica_under_load"]["p50_ms"]
    out = {
        "what": "one hot corpus past a holder's fan-in elbow: replica added, latency, removed",
        "command": "python -m tools.bench_fanin "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "load_average_after": [round(x, 2) for x in load],
        "setup": {
            "holders": a.holders,
            "max_flows_elbow": a.max_flows,
            "holder_threads": 1,
            "corpus_tokens": a.tokens,
            "rows": a.rows,
            "k": min(a.k, a.tokens),
            "heads": cfg.num_attention_heads,
            "replica_window_s": a.window_s,
            "lease_s": 3,
            "requester_refresh_s": a.refresh_s,
            "arrivals": "open-loop Poisson",
        },
        **meta,
        "phases": stats,
        "recovered_p50_over_baseline": round(rec / base, 2) if base else None,
        "with_replica_p50_over_baseline": round(used / base, 2) if base else None,
        "events": run.events,
        "coordinator_log": [ln for ln in log.splitlines() if "load replica" in ln],
        "replica_actions": actions(log, run),
        "stale_view_not_found_retried": [round(t, 2) for t in run.stale],
        "errors": run.errors[:10],
        "error_count": len(run.errors),
        "exit_codes": codes,
        "per_second": rows,
        "samples": run.samples,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    png = Path(a.plot or str(Path(a.out).with_suffix(".png")))
    title = (
        f"bench_fanin: {a.holders} holders, elbow {a.max_flows}, window {a.window_s:g} s, "
        f"requester re-reads the page table every {a.refresh_s:g} s; {out['machine']}"
    )
    plot(rows, run, out["replica_actions"], meta["hot_holder"], png, title)
    print(f"\n{'phase':>22} {'from s':>7} {'done':>5} {'refused':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for name, s in stats.items():
        if "from_s" in s:
            print(
                f"{name:>22} {s['from_s']:>7} {s['done']:>5} {s.get('refused', 0):>7} "
                f"{s['p50_ms']:>8} {s['p99_ms']:>8}"
            )
    print(f"recovered p50 / baseline p50: {out['recovered_p50_over_baseline']}")
    print(
        f"with the replica in the requester's view, under load: {stats['with_replica_under_load']}"
    )
    for ln in out["coordinator_log"]:
        print(ln)
    print(f"wrote {a.out} and {png}")
    return 0 if not run.errors else 1


if __name__ == "__main__":
    sys.exit(main())
