"""Replicas that follow load (issue 21): one hot corpus driven past a real holder's fan-in elbow by
real Attend calls; the leader adds a replica, latency comes back, the load stops, the replica goes.

    python -m tools.bench_fanin --out bench/results/fanin-replicas-cpu.json

Starts a coordinator (SQLite, ``--lease-s`` 3: a heartbeat a second, ``--replica-window-s``),
``--holders`` holders (``--max-flows``: the elbow each reports; torch threads: ``--cpus-per-holder``
or 1), and pins a synthetic corpus whole on one holder (1 replica). Requests arrive open-loop at a
fixed rate (Poisson), each an Attend of ``--rows`` query rows over ``--k`` random corpus positions
at layer 0, routed the way a requester routes them: the page table's ``CorpusView``
(replicated pages spread by each holder's measured speed, ``--spread speed``, as corpusd's
fan-out does; or page ``p`` on replica ``p mod n``, ``--spread page``), one ``Attend`` per
holder, LSE-merged. The requester re-reads the page table every ``--refresh-s`` (default
lease / 3, as an agent worker's ``--table-refresh-s``
does; 0: read once).

``--cpus-per-holder N`` gives each holder N cores of its own (every thread pinned, N torch
threads), the coordinator one, and this process (the load generator and requester) the rest:
the run that shows what a second holder's own compute does (on a shared machine it adds none).

Phases: ``baseline`` (``--low`` × what one holder completes saturated, measured first),
``overload`` (``--high`` ×) until the page table shows the replica, ``continued`` (the same
rate, ``--continued-s``), ``idle`` (no load) until the replica is removed. Per second:
completed requests, latency p50/p99, refusals, each holder's fan-in (flows running + queued,
from its ``/metrics``), replicas in the page table and in the requester's view.
Prints a table, writes JSON and, with matplotlib installed, a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.model import ModelConfig
from corpusd.model.tiny import init_tiny
from corpusd.testing.holders import start_holders, synthetic_corpus
from holder.launch import HolderProcess
from tools import cpu_pin
from tools.fanin_report import Run, actions, holder_stats, pct, per_second, phase_stats, plot
from tools.fanin_requester import Requester
from tools.summarize_results import summarize

REPLICAS = "corpusd_coordinator_load_replicas_total"


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
        names: dict[str, str] = {}
        for info in await cc.list_holders():
            hid_port[info.info.holder_id] = port_of[info.info.address]
            names[info.info.address] = info.info.holder_id
        req = Requester(cc, table, scale, d_v, a.spread)
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
        run = Run(time.perf_counter(), names=names)
        req.calls = run.calls  # from here on: each holder's calls, for per_holder
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
    meta["rebalances"] = [
        {"t_s": round(t - run.t0, 2), "weights": {run.names.get(k, k): x for k, x in w.items()}}
        for t, w in req.rebalances[:200]
    ]
    return run, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench/results/fanin-replicas-cpu.json")
    p.add_argument("--plot", default="", help="default: --out with .png; 'none': no plot")
    p.add_argument("--holders", type=int, default=2)
    p.add_argument("--max-flows", type=int, default=1, help="each holder's elbow (--max-flows)")
    p.add_argument(
        "--cpus-per-holder",
        type=int,
        default=0,
        help="pin each holder to this many cores of its own (its torch threads), the "
        "coordinator to one, this process to the rest; 0: no pinning, 1 torch thread a holder",
    )
    p.add_argument("--tokens", type=int, default=4096, help="corpus tokens (64-token pages)")
    p.add_argument("--rows", type=int, default=8, help="query rows per Attend")
    p.add_argument("--k", type=int, default=4096, help="corpus positions per query row")
    p.add_argument("--low", type=float, default=0.3, help="baseline rate × one holder's capacity")
    p.add_argument("--high", type=float, default=1.15, help="overload rate × one holder's capacity")
    p.add_argument(
        "--spread",
        choices=("speed", "page"),
        default="speed",
        help="replicated pages: by measured holder speed (the fan-out's way) or page p on "
        "replica p mod n",
    )
    p.add_argument("--window-s", type=float, default=5.0, help="coordinator --replica-window-s")
    p.add_argument("--lease-s", type=float, default=3.0, help="coordinator --lease-s")
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
        default=-1.0,
        help="the requester re-reads the page table this often; -1: lease / 3 (an agent "
        "worker's --table-refresh-s default); 0: never",
    )
    p.add_argument("--calibrate-s", type=float, default=6.0, help="one holder saturated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="", help="keep the daemons' state and logs here")
    a = p.parse_args(argv)
    if a.holders < 2:
        p.error(f"--holders {a.holders}: a replica needs a second holder (at least 2)")
    if a.cpus_per_holder < 0 or not a.lease_s > 0 or (a.refresh_s < 0 and a.refresh_s != -1):
        p.error("--cpus-per-holder must be >= 0, --lease-s > 0, --refresh-s >= 0 or -1")
    if a.refresh_s == -1:
        a.refresh_s = a.lease_s / 3
    cores: dict[str, list[int]] = {}
    if a.cpus_per_holder:
        n = a.holders
        try:  # holders' blocks, the coordinator's core, the load's core, the rest (the load's)
            b = cpu_pin.blocks(
                [a.cpus_per_holder] * n + [1, 1], cpu_pin.by_core(cpu_pin.available())
            )
        except ValueError as e:
            p.error(f"--cpus-per-holder {a.cpus_per_holder} × {n} holders, 1 core for the "
                    f"coordinator and at least 1 for the load: {e}")  # fmt: skip
        mine = [*b[n + 1], *b[n + 2]]
        cores = {"coordinator": b[n], "load": mine, **{f"h{i}": b[i] for i in range(n)}}
        cpu_pin.pin(os.getpid(), mine)
        torch.set_num_threads(min(2, len(mine)))  # the merge is small; idle OpenMP threads spin
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
        root / "coord", store, "--profile", str(profile), "--lease-s", f"{a.lease_s:g}",
        "--replica-window-s", str(a.window_s),
    )  # fmt: skip
    threads = a.cpus_per_holder or 1
    cap = str(2 * a.tokens)
    flags = ("--capacity-tokens", cap, "--max-flows", str(a.max_flows), "--queue-timeout-s", "30",
             "--threads", str(threads))  # fmt: skip
    hs: list[HolderProcess] = []
    try:
        hs = start_holders(store, root, model, co.address, a.holders, *flags)
        if cores:
            cpu_pin.pin(co.proc.pid, cores["coordinator"])
            for i, h in enumerate(hs):
                cpu_pin.pin(h.proc.pid, cores[f"h{i}"])
            print("cores: " + ", ".join(f"{k} {cpu_pin.span(v)}" for k, v in cores.items()))
        run, meta = asyncio.run(
            drive(
                a, co.address, co.metrics_port, hs, cid, cfg.softmax_scale,
                cfg.num_attention_heads, cfg.kv_dim, cfg.kv_lora_rank, a.tokens,
            )
        )  # fmt: skip
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
            "holder_threads": threads,
            "cores": {k: cpu_pin.span(v) for k, v in cores.items()} or "not pinned",
            # which holder ran on which block: tells a slow core block from a slow role
            "holder_cores": {
                run.names.get(h.address, h.address): cpu_pin.span(cores[f"h{i}"])
                for i, h in enumerate(hs)
            }
            if cores
            else {},
            "corpus_tokens": a.tokens,
            "rows": a.rows,
            "k": min(a.k, a.tokens),
            "heads": cfg.num_attention_heads,
            "replica_window_s": a.window_s,
            "lease_s": a.lease_s,
            "requester_refresh_s": a.refresh_s,
            "arrivals": "open-loop Poisson",
            "spread": a.spread,
        },
        **meta,
        "phases": stats,
        "per_holder": holder_stats(run),
        "rebalances": meta.pop("rebalances"),
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
    png = None if a.plot == "none" else Path(a.plot or str(Path(a.out).with_suffix(".png")))
    title = (
        f"bench_fanin: {a.holders} holders, elbow {a.max_flows}, window {a.window_s:g} s, "
        f"requester re-reads the page table every {a.refresh_s:g} s; {out['machine']}"
    )
    if png is not None and not plot(rows, run, out["replica_actions"], meta["hot_holder"], png,
                                    title):  # fmt: skip
        print("no plot: matplotlib is not installed (python -m tools.fanin_report draws it later)")
        png = None
    summarize(Path(a.out))  # the timeline moves to <out>.gz; the JSON keeps its summary
    print(f"\n{'phase':>22} {'from s':>7} {'done':>5} {'refused':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for name, s in stats.items():
        if "from_s" in s:
            print(
                f"{name:>22} {s['from_s']:>7} {s['done']:>5} {s.get('refused', 0):>7} "
                f"{s['p50_ms']:>8} {s['p99_ms']:>8}"
            )
    print(f"recovered p50 / baseline p50: {out['recovered_p50_over_baseline']}")
    for name in ("baseline", "continued"):
        print(f"per holder, {name}: {out['per_holder'].get(name)}")
    print(
        f"with the replica in the requester's view, under load: {stats['with_replica_under_load']}"
    )
    for ln in out["coordinator_log"]:
        print(ln)
    print(f"wrote {a.out}" + (f" and {png}" if png is not None else ""))
    return 0 if not run.errors else 1


if __name__ == "__main__":
    sys.exit(main())
