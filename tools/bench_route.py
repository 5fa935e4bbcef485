"""Route round trip over gRPC loopback, next to its floor, and the holder's fan-in elbow.

    python -m tools.bench_route            # full matrix + fan-in sweep (a few minutes on 2 cores)
    python -m tools.bench_route --quick    # a small subset (smoke run)

1. Matrix: rows ∈ {1, 16, 64, 256, 1024} × heads ∈ {16, 128} × k ∈ {512, 2048}, q and O in bf16 on
   the wire (the pool is fp32). Per cell: p50/p99 round trip, the holder-reported compute time,
   payload bytes and effective GB/s, and the floor measured in the same run = an empty RPC's
   round trip + payload bytes / loopback TCP bandwidth. ``ratio`` = p50 / (floor + compute).
2. Fan-in: N = 1…32 concurrent requesters (own channel each; rows 16, h 64, k 2048) against one
   holder with --max-flows 8 and one torch thread per flow: p50 latency and aggregate rows/s.
Writes bench/results/route-grpc-cpu.json and bench/results/route-fanin-cpu.png.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corpusd.corpus.pin import PinConfig, pin
from corpusd.model.tiny import init_tiny
from holder.launch import HolderProcess, start_holder
from requester.holder_client import HolderClient
from tools.bench_pin import make_corpus

SCALE = 0.05


def loopback_gbps(total: int = 1 << 30, chunk: int = 4 << 20) -> float:
    """One-direction TCP throughput over 127.0.0.1 (GB/s), the transport's raw ceiling."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(chunk)
        while got[0] < total:
            n = conn.recv_into(buf)
            if not n:
                break
            got[0] += n
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    cli = socket.create_connection(srv.getsockname())
    data = b"\0" * chunk
    t0 = time.perf_counter()
    for _ in range(total // chunk):
        cli.sendall(data)
    t.join()
    dt = time.perf_counter() - t0
    cli.close()
    srv.close()
    return total / dt / 1e9


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def empty_rtt_us(address: str, n: int = 300) -> float:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest(service="")
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await stub.Check(req)
            times.append(time.perf_counter() - t)
    return statistics.median(times[20:]) * 1e6


def make_request(
    rows: int, heads: int, k: int, frames: dict[int, int], tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 576, generator=g).to(torch.bfloat16)
    pos = torch.stack([torch.randperm(tokens, generator=g)[:k] for _ in range(rows)])
    pool = torch.tensor([frames[p // 64] * 64 + p % 64 for p in range(tokens)])
    return q, pool[pos].to(torch.int32)


async def cell(
    c: HolderClient,
    cid: str,
    rows: int,
    heads: int,
    k: int,
    frames: dict[int, int],
    tokens: int,
    budget_s: float,
) -> dict[str, float]:
    q, idx = make_request(rows, heads, k, frames, tokens, rows * heads + k)
    await c.attend_rows(cid, 0, q, idx, SCALE)  # warm-up
    rtts: list[float] = []
    computes: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(rtts) < 5 or (time.perf_counter() < t_end and len(rtts) < 50):
        t = time.perf_counter()
        r = await c.attend_rows(cid, 0, q, idx, SCALE)
        rtts.append(time.perf_counter() - t)
        computes.append(r.compute_us)
    payload = q.numel() * 2 + idx.numel() * 4 + rows * heads * (512 * 2 + 4)
    return {
        "rows": rows,
        "heads": heads,
        "k": k,
        "n": len(rtts),
        "payload_bytes": payload,
        "p50_us": statistics.median(rtts) * 1e6,
        "p99_us": pct(rtts, 99) * 1e6,
        "compute_p50_us": statistics.median(computes),
    }


async def fanin(
    address: str, cid: str, frames: dict[int, int], tokens: int, ns: list[int], rounds: int
) -> list[dict[str, float]]:
    rows, heads, k = 16, 64, 2048
    q, idx = make_request(rows, heads, k, frames, tokens, 7)
    out = []
    for n in ns:
        clients = [HolderClient(address) for _ in range(n)]
        # connect, warm
        await asyncio.gather(*(c.attend_rows(cid, 0, q, idx, SCALE) for c in clients))
        lat: list[float] = []

        async def one(c: HolderClient, lat: list[float] = lat) -> None:
            for _ in range(rounds):
                t = time.perf_counter()
                await c.attend_rows(cid, 0, q, idx, SCALE)
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in clients))
        wall = time.perf_counter() - t0
        for c in clients:
            await c.close()
        out.append(
            {
                "requesters": n,
                "p50_ms": statistics.median(lat) * 1e3,
                "p99_ms": pct(lat, 99) * 1e3,
                "rows_per_s": n * rounds * rows / wall,
            }
        )
        print(
            f"fan-in N={n:>2}: p50 {out[-1]['p50_ms']:7.1f} ms, "
            f"{out[-1]['rows_per_s']:8.0f} rows/s",
            file=sys.stderr,
        )
    return out


def plot(rows: list[dict[str, float]], path: Path, max_flows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["requesters"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(n, [r["p50_ms"] for r in rows], "o-", label="p50 latency (ms)")
    ax.set_xlabel("concurrent requesters (fan-in)")
    ax.set_ylabel("p50 latency, ms")
    ax2 = ax.twinx()
    ax2.plot(n, [r["rows_per_s"] for r in rows], "s--", color="tab:orange", label="rows/s")
    ax2.set_ylabel("aggregate rows/s")
    ax.axvline(max_flows, color="gray", ls=":", label=f"--max-flows {max_flows}")
    ax.set_title("holder fan-in, gRPC loopback, CPU (rows 16, h 64, k 2048)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(
    a: argparse.Namespace,
    model: Path,
    store: Path,
    cid: str,
    tokens: int,
    h_matrix: HolderProcess,
    h_fanin: HolderProcess,
) -> dict[str, object]:
    gbps = loopback_gbps()
    rtt = await empty_rtt_us(h_matrix.address)
    print(f"loopback TCP {gbps:.2f} GB/s, empty RPC p50 {rtt:.0f} us", file=sys.stderr)
    c = HolderClient(h_matrix.address)
    frames = await c.assign(cid)
    grid = [(r, h, k) for r in a.rows for h in a.heads for k in a.ks]
    cells = []
    for r, h, k in grid:
        res = await cell(c, cid, r, h, k, frames, tokens, a.budget)
        floor = rtt + res["payload_bytes"] / (gbps * 1e3)
        res.update(
            floor_us=floor,
            gb_per_s=res["payload_bytes"] / res["p50_us"] / 1e3,
            ratio=res["p50_us"] / (floor + res["compute_p50_us"]),
        )
        cells.append(res)
        print(
            f"rows {r:>4} h {h:>3} k {k:>4}: p50 {res['p50_us'] / 1e3:9.2f} ms  compute "
            f"{res['compute_p50_us'] / 1e3:9.2f} ms  floor {floor / 1e3:7.2f} ms  "
            f"ratio {res['ratio']:.2f}",
            file=sys.stderr,
        )
    await c.close()
    cf = HolderClient(h_fanin.address)
    frames_f = await cf.assign(cid)
    await cf.close()
    fan = await fanin(h_fanin.address, cid, frames_f, tokens, a.fanin, a.rounds)
    return {"loopback_gbps": gbps, "empty_rpc_p50_us": rtt, "cells": cells, "fanin": fan}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget", type=float, default=3.0, help="seconds per matrix cell")
    p.add_argument("--rounds", type=int, default=6, help="requests per requester in fan-in")
    p.add_argument("--out", default="bench/results/route-grpc-cpu.json")
    a = p.parse_args()
    a.rows, a.heads, a.ks = [1, 16, 64, 256, 1024], [16, 128], [512, 2048]
    a.fanin = [1, 2, 4, 6, 8, 12, 16, 24, 32]
    if a.quick:
        a.rows, a.heads, a.ks, a.fanin, a.budget, a.rounds = (
            [1, 64],
            [128],
            [2048],
            [1, 4, 8],
            1.0,
            3,
        )
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        model = init_tiny(t / "model", preset="sglang")  # the shape its results were measured on
        (t / "src").mkdir()
        make_corpus(t / "src", 4200)
        r = pin(
            PinConfig(corpus=str(t / "src"), model=str(model), store=str(t / "store")),
            io.StringIO(),
        )
        cid, tokens = r.manifest.corpus_id, r.manifest.token_count
        cores = str(os.cpu_count() or 1)
        h1 = start_holder(t / "store", t / "h1", model, "--threads", cores, "--metrics-port", "-1")
        h2 = start_holder(
            t / "store",
            t / "h2",
            model,
            "--threads",
            "1",
            "--max-flows",
            "8",
            "--metrics-port",
            "-1",
        )
        try:
            res = asyncio.run(run(a, model, t / "store", cid, tokens, h1, h2))
        finally:
            h1.stop()
            h2.stop()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res.update(
        command="python -m tools.bench_route" + (" --quick" if a.quick else ""),
        machine={"cpus": os.cpu_count(), "torch": torch.__version__},
        what="gRPC loopback route round trip (bf16 q/O on the wire, fp32 pool, torch kernel)",
    )
    out.write_text(json.dumps(res, indent=2))
    plot(res["fanin"], out.with_name("route-fanin-cpu.png"), 8)  # type: ignore[arg-type]
    print(
        f"\nloopback {res['loopback_gbps']:.2f} GB/s; "
        f"empty RPC p50 {res['empty_rpc_p50_us']:.0f} us"
    )
    print(
        f"{'rows':>5} {'h':>4} {'k':>5} {'p50 ms':>9} {'p99 ms':>9} {'compute':>9} {'floor':>8} "
        f"{'GB/s':>6} {'ratio':>6}"
    )
    for c in res["cells"]:  # type: ignore[attr-defined]
        print(
            f"{c['rows']:>5} {c['heads']:>4} {c['k']:>5} {c['p50_us'] / 1e3:>9.2f} "
            f"{c['p99_us'] / 1e3:>9.2f} {c['compute_p50_us'] / 1e3:>9.2f} "
            f"{c['floor_us'] / 1e3:>8.2f} "
            f"{c['gb_per_s']:>6.2f} {c['ratio']:>6.2f}"
        )
    print(f"{'N':>4} {'p50 ms':>9} {'rows/s':>9}")
    for f in res["fanin"]:  # type: ignore[attr-defined]
        print(f"{f['requesters']:>4} {f['p50_ms']:>9.1f} {f['rows_per_s']:>9.0f}")
    print(f"wrote {out} and {out.with_name('route-fanin-cpu.png')}")


if __name__ == "__main__":
    main()
