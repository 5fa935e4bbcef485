"""GPU data-plane benchmarks: kernels under fan-in, CUDA-graph buckets, K-stream staging, and
(with two GPUs) the NVSHMEM route, route/fetch/local crossover and a distributed decode step.

    python -m tools.bench_gpu single --out bench/results/gpu-single-h200.json   # one GPU
    python -m tools.bench_gpu pair --out bench/results/gpu-pair-h200x2.json     # two GPUs

Each part prints a table and writes JSON (and a PNG next to it when matplotlib is present).
Every timing is a median over repetitions with CUDA events (device time) or host clocks after
a synchronize (wall time, said so in the key); inputs are random, never zeros.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tools.gpu_timing import (
    D_V,
    D,
    K,
    ceilings,
    command,
    device_ms,
    env_info,
    graph_us,
    kernels_on,
    med,
    random_pool,
    random_request,
    save,
    wall_us,
)

# -- part 1: holder partial under fan-in ----------------------------------------------------------


def part_fanin(dev: torch.device, ceil: dict[str, float], quick: bool) -> dict[str, Any]:
    """N concurrent requesters (rows 1–64 each, k 2048) against one pool of 256k tokens.
    ``streams``: each request its own stream and launch (the holder's flows as they are);
    ``batched``: all N requests' rows in one launch (what an admission batcher would do).
    Device time of graph replays (host launch cost is measured apart, in the graph part)."""
    pool_tokens = 1 << 18
    pool = random_pool(pool_tokens, dev)
    fns = kernels_on(dev)
    fanins = [1, 2, 4, 8, 16, 32]
    streams = [torch.cuda.Stream(dev) for _ in range(max(fanins))]
    rows_rng = torch.Generator().manual_seed(1)
    rows_of = {n: torch.randint(1, 65, (n,), generator=rows_rng).tolist() for n in fanins}
    points = []
    for h in (16, 64, 128):
        for n in fanins:
            g = torch.Generator(device=dev).manual_seed(n * 1000 + h)
            reqs = [random_request(g, r, h, K, pool_tokens, dev) for r in rows_of[n]]
            q_all = torch.cat([q for q, _ in reqs])
            i_all = torch.cat([i for _, i in reqs])
            total = q_all.shape[0]
            for name, fn in fns.items():
                reps = 3 if name == "torch" else (5 if quick else 15)
                scale = D**-0.5

                def concurrent(
                    fn: Callable[..., Any] = fn, reqs: list[Any] = reqs, scale: float = scale
                ) -> None:
                    cur = torch.cuda.current_stream(dev)
                    for s, (q, i) in zip(streams, reqs, strict=False):
                        s.wait_stream(cur)
                        with torch.cuda.stream(s):
                            fn(q, pool, i, scale, D_V)
                    for s in streams[: len(reqs)]:
                        cur.wait_stream(s)

                def batched(
                    fn: Callable[..., Any] = fn,
                    q: Any = q_all,
                    i: Any = i_all,
                    scale: float = scale,
                ) -> None:
                    fn(q, pool, i, scale, D_V)

                if name == "torch":  # syncs on the host (index check): eager events
                    t_streams = med(device_ms(concurrent, reps))
                    t_batched = med(device_ms(batched, reps))
                else:
                    t_streams = med(graph_us(concurrent, 4, reps)) / 1e3
                    t_batched = med(graph_us(batched, 4, reps)) / 1e3
                gathered = total * K * D * 2  # each row reads its own k pool rows once
                flops = 2 * total * h * K * (D + D_V)
                floor_ms = max(
                    gathered / ceil["copy_GBps"] / 1e6,  # copy_GBps counts all bytes moved
                    flops / ceil["bf16_TFLOPs"] / 1e9,
                )
                points.append(
                    {
                        "kernel": name,
                        "heads": h,
                        "fanin": n,
                        "rows": total,
                        "streams_ms": t_streams,
                        "batched_ms": t_batched,
                        "floor_ms": floor_ms,
                    }
                )
                print(
                    f"fanin {name:8s} h={h:3d} N={n:2d} rows={total:4d} streams "
                    f"{t_streams:8.3f} ms batched {t_batched:8.3f} ms floor {floor_ms:.3f} ms",
                    flush=True,
                )
    return {"pool_tokens": pool_tokens, "k": K, "rows_per_requester": rows_of, "points": points}


def elbow(points: list[dict[str, Any]], key: str) -> dict[str, int]:
    """Per (kernel, heads): the largest fan-in whose latency is within 1.5× of fan-in 1."""
    out = {}
    for name in sorted({p["kernel"] for p in points}):
        for h in sorted({p["heads"] for p in points}):
            pts = sorted(
                (p for p in points if p["kernel"] == name and p["heads"] == h),
                key=lambda p: p["fanin"],
            )
            if pts:
                base = pts[0][key]
                flat = [p["fanin"] for p in pts if p[key] <= 1.5 * base]
                out[f"{name}/h{h}"] = max(flat)
    return out


# -- Triton tuning ---------------------------------------------------------------------------------


def part_tune(dev: torch.device) -> dict[str, Any]:
    """Triton kernel configurations at two decode shapes, next to FlashMLA (device time)."""
    from corpusd.kernels.triton_mla import triton_partial_attention

    pool = random_pool(1 << 18, dev, seed=6)
    g = torch.Generator(device=dev).manual_seed(7)
    points = []
    fns = kernels_on(dev)
    for rows, h in ((1, 16), (64, 16), (64, 128)):
        q, i = random_request(g, rows, h, K, pool.shape[0], dev)
        if "flashmla" in fns:
            t = med(graph_us(partial(fns["flashmla"], q, pool, i, D**-0.5, D_V)))
            points.append({"rows": rows, "heads": h, "config": "flashmla", "us": t})
            print(f"tune rows={rows} h={h} flashmla {t:8.1f} us", flush=True)
        for bh in (16, 32, 64):
            for bn in (32, 64):
                for warps in (4, 8):
                    cfg: dict[str, Any] = {"block_h": bh, "block_n": bn, "num_warps": warps}
                    try:
                        t = med(
                            graph_us(
                                partial(triton_partial_attention, q, pool, i, D**-0.5, D_V, **cfg)
                            )
                        )
                    except Exception as e:  # out of shared memory / registers: skip the config
                        print(f"tune {cfg} failed: {type(e).__name__}", flush=True)
                        continue
                    points.append({"rows": rows, "heads": h, "config": cfg, "us": t})
                    print(f"tune rows={rows} h={h} triton {cfg} {t:8.1f} us", flush=True)
    # Does a kernel's time depend on the pool it indexes into (not only on the rows it reads)?
    pool_dep = []
    for tokens in (1 << 14, 1 << 16, 1 << 18, 1 << 20):
        big = random_pool(tokens, dev, seed=8)
        q, i = random_request(g, 1, 64, K, tokens, dev)
        for name, fn in fns.items():
            if name == "torch":
                continue
            t = med(graph_us(partial(fn, q, big, i, D**-0.5, D_V)))
            pool_dep.append({"pool_tokens": tokens, "kernel": name, "us": t})
            print(f"tune pool={tokens:8d} rows=1 h=64 {name:8s} {t:8.1f} us", flush=True)
        del big
    return {"points": points, "pool_size": pool_dep}


# -- CUDA-graph buckets ----------------------------------------------------------------------------


def part_graphs(dev: torch.device, quick: bool) -> dict[str, Any]:
    """Per decode size: host wall time of one eager call vs one graph replay (both + sync), and
    the device time of the replay; for the holder's partial and the requester's 2-way merge."""
    from corpusd.cuda_graphs import GraphBuckets, InputSpec
    from corpusd.kernels.merge import merge_partials

    pool_tokens = 1 << 18
    pool = random_pool(pool_tokens, dev, seed=2)
    scale = D**-0.5
    reps = 50 if quick else 200
    points = []
    g = torch.Generator(device=dev).manual_seed(3)
    for name, fn in kernels_on(dev).items():
        if name == "torch":
            continue
        for h in (16, 128):
            buckets = GraphBuckets(
                lambda q, i, fn=fn: fn(q, pool, i, scale, D_V),
                [InputSpec((h, D), torch.bfloat16, 0.0), InputSpec((K,), torch.int32, -1)],
                dev,
                buckets=(1, 2, 4, 8, 16, 32, 64),
            )
            for n in (1, 4, 16, 64):
                q, i = random_request(g, n, h, K, pool_tokens, dev)
                ref = fn(q, pool, i, scale, D_V)
                got = buckets(q, i)
                exact = bool(torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]))
                eager = med(wall_us(partial(fn, q, pool, i, scale, D_V), reps))
                graph = med(wall_us(partial(buckets, q, i), reps))
                dev_us = 1e3 * med(device_ms(partial(buckets, q, i), reps))
                points.append(
                    {
                        "what": f"partial/{name}",
                        "heads": h,
                        "rows": n,
                        "eager_wall_us": eager,
                        "graph_wall_us": graph,
                        "graph_device_us": dev_us,
                        "saved_us": eager - graph,
                        "bitwise_equal": exact,
                    }
                )
                print(
                    f"graph partial/{name:8s} h={h:3d} n={n:3d} eager {eager:7.1f} us graph "
                    f"{graph:7.1f} us device {dev_us:7.1f} us equal={exact}",
                    flush=True,
                )
    h = 128

    def merge2(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> Any:
        return merge_partials([(o1, l1), (o2, l2)])

    specs = [
        InputSpec((h, D_V), torch.bfloat16, 0.0),
        InputSpec((h,), torch.float32, float("-inf")),
    ] * 2
    mb = GraphBuckets(merge2, specs, dev, buckets=(1, 2, 4, 8, 16, 32, 64))
    for n in (1, 4, 16, 64):
        args = [
            torch.randn(n, h, D_V, device=dev, dtype=torch.bfloat16),
            torch.randn(n, h, device=dev),
        ] * 2
        eager = med(wall_us(partial(merge2, *args), reps))
        graph = med(wall_us(partial(mb, *args), reps))
        dev_us = 1e3 * med(device_ms(partial(mb, *args), reps))
        points.append(
            {
                "what": "merge2",
                "heads": h,
                "rows": n,
                "eager_wall_us": eager,
                "graph_wall_us": graph,
                "graph_device_us": dev_us,
                "saved_us": eager - graph,
            }
        )
        print(
            f"graph merge2 h={h} n={n:3d} eager {eager:7.1f} us graph {graph:7.1f} us "
            f"device {dev_us:7.1f} us",
            flush=True,
        )
    return {"k": K, "points": points}


# -- K-stream staging ------------------------------------------------------------------------------


def part_staging(dev: torch.device, quick: bool) -> dict[str, Any]:
    """32 flows staged back to back: each gathers a fetch of 16 pages (1024 rows × 576 bf16) into
    a device send buffer and copies its partial (64 × 128 × 512 bf16 + LSE) and the pages to
    pinned host buffers (the gRPC path); ``device_only`` leaves out the host copies (the NVSHMEM
    path stages into symmetric device buffers). Makespan per K."""
    from holder.staging import StagingPool

    pool = random_pool(1 << 18, dev, seed=4)
    flows = 32
    g = torch.Generator(device=dev).manual_seed(5)
    rows = [torch.randint(0, pool.shape[0], (1024,), generator=g, device=dev) for _ in range(flows)]
    send = [torch.empty(1024, D, device=dev, dtype=torch.bfloat16) for _ in range(flows)]
    send_o = [torch.empty(64, 128, D_V, device=dev, dtype=torch.bfloat16) for _ in range(flows)]
    o = [torch.randn(64, 128, D_V, device=dev, dtype=torch.bfloat16) for _ in range(flows)]
    lse = [torch.randn(64, 128, device=dev) for _ in range(flows)]
    host_pages = [torch.empty(1024, D, dtype=torch.bfloat16, pin_memory=True) for _ in range(flows)]
    host_o = [
        torch.empty(64, 128, D_V, dtype=torch.bfloat16, pin_memory=True) for _ in range(flows)
    ]
    host_l = [torch.empty(64, 128, pin_memory=True) for _ in range(flows)]
    d2h_bytes = flows * (1024 * D * 2 + 64 * 128 * (D_V * 2 + 4))
    points = []
    for k in (1, 2, 4, 8, 16):
        sp = StagingPool(k, dev)
        for mode in ("host", "device_only"):

            def run(sp: StagingPool = sp, mode: str = mode) -> None:
                events = []
                for f in range(flows):
                    hp = host_pages[f] if mode == "host" else None
                    events.append(sp.gather(pool, rows[f], send[f], hp))
                    if mode == "host":
                        events.append(sp.copy([(o[f], host_o[f]), (lse[f], host_l[f])]))
                    else:
                        events.append(sp.copy([(o[f], send_o[f])]))
                for e in events:
                    torch.cuda.current_stream(dev).wait_event(e)

            if mode == "host":  # PCIe-bound; pinned-host copies are not worth capturing
                t = med(device_ms(run, 5 if quick else 15))
            else:
                t = med(graph_us(run, 2, 5 if quick else 15)) / 1e3
            gbps = d2h_bytes / t / 1e6 if mode == "host" else float("nan")
            points.append({"streams": k, "mode": mode, "makespan_ms": t, "d2h_GBps": gbps})
            print(f"staging K={k:2d} {mode:11s} {t:7.3f} ms  d2h {gbps:6.1f} GB/s", flush=True)
    return {"flows": flows, "points": points}


def staging_elbow(points: list[dict[str, Any]], mode: str) -> int:
    """Smallest K within 10% of the best makespan."""
    pts = [p for p in points if p["mode"] == mode]
    best = min(p["makespan_ms"] for p in pts)
    return min(p["streams"] for p in pts if p["makespan_ms"] <= 1.1 * best)


# -- plots -----------------------------------------------------------------------------------------


def plot_fanin(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    pts = result["points"]
    heads = sorted({p["heads"] for p in pts})
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
    for ax, h in zip(axes[0], heads, strict=True):
        for name in sorted({p["kernel"] for p in pts}):
            sel = sorted(
                (p for p in pts if p["kernel"] == name and p["heads"] == h),
                key=lambda p: p["fanin"],
            )
            xs = [p["fanin"] for p in sel]
            ax.plot(xs, [p["streams_ms"] for p in sel], "o-", label=f"{name} (streams)")
            ax.plot(xs, [p["batched_ms"] for p in sel], "x--", label=f"{name} (batched)")
        ax.set(xscale="log", yscale="log", xlabel="fan-in N", ylabel="ms", title=f"h={h}, k=2048")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# -- main ------------------------------------------------------------------------------------------


def single(args: argparse.Namespace) -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ceil = ceilings(dev)
    print(f"ceilings: {ceil}", flush=True)
    result: dict[str, Any] = {"command": command(), "env": env_info(dev), "ceilings": ceil}
    if args.tune:
        result["tune"] = part_tune(dev)
        save(args.out, result)
    result["fanin"] = part_fanin(dev, ceil, args.quick)
    result["fanin"]["elbow_streams"] = elbow(result["fanin"]["points"], "streams_ms")
    result["fanin"]["elbow_batched"] = elbow(result["fanin"]["points"], "batched_ms")
    save(args.out, result)
    result["graphs"] = part_graphs(dev, args.quick)
    save(args.out, result)
    result["staging"] = part_staging(dev, args.quick)
    result["staging"]["elbow_host"] = staging_elbow(result["staging"]["points"], "host")
    result["staging"]["elbow_device"] = staging_elbow(result["staging"]["points"], "device_only")
    save(args.out, result)
    plot_fanin(result["fanin"], args.out.with_suffix(".png"))
    print("elbows (fan-in within 1.5x of N=1):", result["fanin"]["elbow_streams"])
    print("elbows batched:", result["fanin"]["elbow_batched"])
    print("staging elbow K (host, device):", result["staging"]["elbow_host"],
          result["staging"]["elbow_device"])  # fmt: skip


def agents_list(text: str) -> tuple[int, ...]:
    """``--step-agents``: comma-separated agent counts, each 1 … 4096."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if not counts or not all(1 <= c <= 4096 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count 1 to 4096")
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("single", help="one GPU: fan-in, graph buckets, staging")
    s.add_argument("--out", type=Path, default=Path("bench/results/gpu-single.json"))
    s.add_argument("--quick", action="store_true", help="fewer repetitions")
    s.add_argument("--tune", action="store_true", help="also sweep Triton block configurations")
    pr = sub.add_parser("pair", help="two GPUs: NVSHMEM/gRPC route, crossover, decode step")
    pr.add_argument("--out", type=Path, default=Path("bench/results/gpu-pair.json"))
    pr.add_argument("--quick", action="store_true", help="fewer repetitions")
    pr.add_argument(
        "--step-only", action="store_true",
        help="only (4), the distributed decode step against monolithic (a short device call)",
    )  # fmt: skip
    pr.add_argument(
        "--step-agents", type=agents_list, default=(32,),
        help="with --step-only: the step at each of these agent counts (comma-separated; the "
        "first is the JSON's decode_step, all are decode_step_by_agents)",
    )  # fmt: skip
    ph = sub.add_parser("pair-holder", help="(internal) the holder process of `pair`")
    ph.add_argument("--port-file", type=Path, required=True)
    ph.add_argument("--device", type=int, default=0)
    ph.add_argument("--fetch-rows", type=int, default=65536)
    ph.add_argument("--rows", type=int, default=64, help="the ring's largest attend request")
    args = ap.parse_args(argv)
    if args.cmd == "single":
        single(args)
    elif args.cmd == "pair":
        from tools.bench_gpu_pair import pair

        pair(args.out, args.quick, args.step_only, args.step_agents)
    else:
        from tools.bench_gpu_pair import holder_main

        holder_main(args.port_file, args.device, args.fetch_rows, args.rows)


if __name__ == "__main__":
    main()
