"""Two-GPU parts of ``tools/bench_gpu.py``: a holder process on GPU 1 (gRPC Holder + NVSHMEM
Transport over a 128k-token random corpus) and the requester in this process on GPU 0.

    python -m tools.bench_gpu pair --out bench/results/gpu-pair-h200x2.json

(2) route round trip at the decode point over NVSHMEM and gRPC, next to the raw NVSHMEM floor
    (echo of the same bytes) and the partial's kernel time; exactness against gRPC.
(3) route vs fetch vs local per chunk size (64 … 64k tokens): the crossover map.
(4) one distributed decode step (32 agents, 256k tokens split over 2 GPUs) vs monolithic;
    `--step-only --step-agents 32,64,128` repeats it at each agent count.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from tools.gpu_timing import (
    D_V,
    D,
    K,
    command,
    env_info,
    graph_us,
    med,
    random_pool,
    random_request,
    save,
)

HOLDER_TOKENS = 1 << 17  # per GPU: 256k tokens over two
PAGE = 64
SPARE_FRAMES = 16  # frames past the corpus: rows there are not the corpus's (bad-row checks)
CORPUS = "bench-corpus"
LAYER_PARAMS = 37e9 / 61  # V3.2 active parameters per layer: the local (re-prefill) proxy


def nv_env() -> None:
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "4G")


# -- holder process --------------------------------------------------------------------------------


def holder_main(port_file: Path, device: int, fetch_rows: int, rows: int = 64) -> None:
    """Serve Holder (gRPC) and Transport (NVSHMEM) over a random corpus until SIGTERM."""
    import signal

    import grpc

    from corpusd.corpus.store import PageStore
    from corpusd.kernels.registry import choose
    from corpusd.v1 import holder_pb2_grpc, transport_pb2_grpc
    from holder.config import HolderConfig
    from holder.metrics import HolderMetrics
    from holder.nvshmem_endpoint import NvshmemEndpoint
    from holder.pool import FramePool, Geometry
    from holder.service import HolderService
    from tools.bench_gpu_grpc import add_probe

    nv_env()
    torch.cuda.set_device(device)
    dev = f"cuda:{device}"
    tmp = Path(tempfile.mkdtemp(prefix="bench-holder-"))
    cfg = HolderConfig(
        store=str(tmp / "store"), state_dir=str(tmp / "state"), device=dev, dtype="bfloat16",
        capacity_tokens=HOLDER_TOKENS + SPARE_FRAMES * PAGE, max_rows=4096, nvshmem_peers=1,
        metrics_port=-1,
    )  # fmt: skip
    geo = Geometry(1, PAGE, D, 128, torch.bfloat16, cfg.frames, dev, d_v=D_V)
    pool = FramePool(geo)
    n_pages = HOLDER_TOKENS // PAGE
    pool.add_corpus(CORPUS, HOLDER_TOKENS, n_pages)
    frames = pool.take_frames(n_pages)
    g = torch.Generator(device=dev).manual_seed(11)
    lat = torch.randn(HOLDER_TOKENS, D, generator=g, device=dev, dtype=torch.bfloat16)
    keys = torch.zeros(PAGE, 128, device=dev, dtype=torch.bfloat16)
    for page, frame in enumerate(frames):
        pool.fill(CORPUS, page, frame, [lat[page * PAGE : (page + 1) * PAGE]], [keys])
    kernel = choose("auto", dev, torch.bfloat16, D, D_V)
    torch.set_num_threads(cfg.host_threads)  # as `corpusd holder` does
    svc = HolderService(cfg, pool, PageStore(cfg.store), kernel, "bench", HolderMetrics())
    from corpusd.transport.nvshmem_ring import RingGeometry

    ring = RingGeometry.for_shapes(1, 2, rows, 128, K, fetch_rows)
    endpoint = NvshmemEndpoint(pool, kernel, ring, f"bench:{os.getpid()}", "localhost")

    async def serve() -> None:
        limit = cfg.max_message_bytes + (1 << 20)
        opts = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        server = grpc.aio.server(options=opts)
        holder_pb2_grpc.add_HolderServicer_to_server(svc, server)
        transport_pb2_grpc.add_TransportServicer_to_server(endpoint, server)
        add_probe(server, svc)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        port_file.write_text(f"{port} {kernel.name}")
        await stop.wait()
        await server.stop(1.0)

    asyncio.run(serve())
    port_file.with_suffix(".stats").write_text(json.dumps(list(endpoint.stream_stats)))
    endpoint.close()
    print("holder: closed", flush=True)


# -- requester -------------------------------------------------------------------------------------


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured as a CUDA graph after two warm-up runs; returns (graph, its outputs)."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        fn()
        fn()
    cur.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def pctl(xs: list[float], q: float) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))])


def stats(xs: list[float]) -> dict[str, float]:
    return {"p50": med(xs), "p10": pctl(xs, 0.1), "p90": pctl(xs, 0.9), "min": min(xs)}


def corpus_rows(g: torch.Generator, n: int, k: int, span: int, dev: torch.device) -> torch.Tensor:
    """``[n, k]`` int32 distinct-per-row pool rows in ``0 … span-1`` (-1 padded when span < k)."""
    take = min(k, span)
    rows = torch.argsort(torch.rand(n, span, generator=g, device=dev), dim=1)[:, :take]
    out = torch.full((n, k), -1, dtype=torch.int32, device=dev)
    out[:, :take] = rows.to(torch.int32)
    return out


async def requester_main(
    address: str,
    holder_kernel: str,
    quick: bool,
    stop_holder: Callable[[], None],
    checkpoint: Callable[[dict[str, Any]], None],
    step_only: bool = False,
    step_agents: tuple[int, ...] = (32,),
) -> dict[str, Any]:
    from corpusd.kernels.reference import partial_attention
    from corpusd.kernels.registry import REGISTRY, choose
    from requester.holder_client import HolderClient
    from requester.nvshmem_client import NvshmemClient, RemoteRowError
    from tools.bench_gpu_grpc import breakdown

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    reps = 30 if quick else 200
    # the holder's "auto" kernel, resolved per request shape as the holder resolves it
    auto = choose("auto", str(dev), torch.bfloat16, D, D_V)
    assert auto.name == holder_kernel, f"holder runs {holder_kernel}, this process {auto.name}"
    scale = D**-0.5
    g = torch.Generator(device=dev).manual_seed(12)
    grpc_client = HolderClient(address)
    out: dict[str, Any] = {"holder_kernel": holder_kernel}
    n = 64
    idx = corpus_rows(g, n, K, HOLDER_TOKENS, dev)
    if not quick and not step_only:  # (2b) gRPC Attend before any NVSHMEM init in either process
        out["grpc_before_join"] = {}
        for heads in (16, 128):
            qh = torch.randn(n, heads, D, generator=g, device=dev, dtype=torch.bfloat16)
            b = await breakdown(address, CORPUS, qh.cpu(), idx.cpu(), scale, 10)
            out["grpc_before_join"][f"h{heads}"] = b
            print(f"gRPC before join h={heads}: {json.dumps(b)}", flush=True)
        checkpoint(out)
    t0 = time.perf_counter()
    nv = await NvshmemClient.join(address, "bench-requester", 0)
    join_s = time.perf_counter() - t0
    print(f"joined NVSHMEM job {nv.job_id} as rank {nv.rank} in {join_s:.2f} s", flush=True)
    out["join_s"] = join_s
    if step_only:  # (4) alone: the holder's pool rebuilt here (it is seeded) as the reference's
        gh = torch.Generator(device=dev).manual_seed(11)
        pool_h = torch.randn(HOLDER_TOKENS, D, generator=gh, device=dev, dtype=torch.bfloat16)
        local_fn = REGISTRY["flashmla"].fn if REGISTRY["flashmla"].available(str(dev)) else auto.fn
        by_agents = {}
        for agents in step_agents:  # the first is the headline's shape
            by_agents[str(agents)] = await decode_step(nv, g, dev, pool_h, local_fn, 128, scale,
                                                       reps, agents)  # fmt: skip
            checkpoint({**out, "decode_step_by_agents": by_agents})
        out["decode_step"] = by_agents[str(step_agents[0])]
        if len(step_agents) > 1:
            out["decode_step_by_agents"] = by_agents
            print_agents_sweep(by_agents)
        await grpc_client.close()
        stop_holder()
        await nv.close()
        return out

    # (2) exactness, bad rows, round trips
    h = 128
    q = torch.randn(n, h, D, generator=g, device=dev, dtype=torch.bfloat16)
    idx[0] = -1  # an empty row
    idx[1, :4] = torch.tensor([0, HOLDER_TOKENS - 1, 1, HOLDER_TOKENS - 2], device=dev)
    p = await grpc_client.attend_rows(CORPUS, 0, q.cpu(), idx.cpu(), scale)
    exact: dict[str, Any] = {}
    for direct in (False, True):
        await nv.open_stream("attend", 2, n, h, K, CORPUS, 0, 1, scale, direct=direct)
        o_nv, lse_nv = nv.attend(q, idx).result(copy=True)
        bad = idx.clone()
        bad[5, 7] = HOLDER_TOKENS + 3  # a spare frame's row: not the corpus's
        try:
            nv.attend(q, bad).result()
            rejected = False
        except RemoteRowError:
            rejected = True
        mode = "direct" if direct else "put"
        exact[f"{mode}_equals_grpc_bitwise"] = bool(
            torch.equal(p.o, o_nv.cpu()) and torch.equal(p.lse, lse_nv.cpu())
        )
        exact[f"{mode}_bad_rows_rejected"] = rejected
    equal = exact["put_equals_grpc_bitwise"] and exact["direct_equals_grpc_bitwise"]
    rejected = exact["put_bad_rows_rejected"] and exact["direct_bad_rows_rejected"]
    # reference: the holder's pool is seeded; rebuild it here to check against torch
    gh = torch.Generator(device=dev).manual_seed(11)
    pool_h = torch.randn(HOLDER_TOKENS, D, generator=gh, device=dev, dtype=torch.bfloat16)
    ref_o, ref_lse = partial_attention(q.float(), pool_h.float(), idx.long(), scale, D_V)
    full = torch.isfinite(ref_lse)
    rel = float((o_nv.float() - ref_o)[full].norm() / ref_o[full].norm())
    out["exact"] = {
        **exact,
        "nvshmem_equals_grpc_bitwise": equal,
        "bad_rows_rejected": rejected,
        "rel_err_vs_torch": rel,
        "empty_row_lse": float(lse_nv[0, 0]),
    }
    print(f"exact: {out['exact']}", flush=True)

    from corpusd.transport import nvshmem_ring as nr

    rtt: dict[str, Any] = {}
    for heads in (16, 128):
        qb, rb = nr.attend_request_bytes(n, heads, K), nr.attend_reply_bytes(n, heads)
        await nv.open_stream("echo", reps + 5, n, echo_bytes=rb)
        times = []
        for i in range(reps + 5):
            t = time.perf_counter()
            nv.echo(qb).result()
            if i >= 5:
                times.append((time.perf_counter() - t) * 1e6)
        rtt[f"echo_h{heads}"] = {"bytes_out": qb, "bytes_back": rb, **stats(times)}
        qh = torch.randn(n, heads, D, generator=g, device=dev, dtype=torch.bfloat16)
        for direct in (False, True):
            mode = "direct" if direct else "put"
            await nv.open_stream(
                "attend", reps + 5, n, heads, K, CORPUS, 0, 1, scale, direct=direct
            )
            times = []
            for i in range(reps + 5):
                t = time.perf_counter()
                nv.attend(qh, idx).result()
                if i >= 5:
                    times.append((time.perf_counter() - t) * 1e6)
            rtt[f"nvshmem_{mode}_attend_h{heads}"] = stats(times)
            # where the requester's stream spends a round trip: copy in, send, wait, status out
            await nv.open_stream("attend", 25, n, heads, K, CORPUS, 0, 1, scale, direct=direct)
            phases: list[list[float]] = [[] for _ in range(4)]
            for i in range(25):
                nv.trace = []
                nv.attend(qh, idx).result()
                ev = nv.trace
                if i >= 5:
                    for j in range(4):
                        phases[j].append(ev[j].elapsed_time(ev[j + 1]) * 1e3)
            nv.trace = None
            key = f"requester_stream_{mode}_h{heads}_us"
            rtt[key] = {
                name: med(ph)
                for name, ph in zip(("copy_in", "send", "wait", "status"), phases, strict=True)
            }
            print(f"requester stream {mode} h={heads}: {rtt[key]}", flush=True)
        kernel = auto.resolve(n, heads)
        rtt[f"kernel_h{heads}"] = kernel.name
        kt = med(graph_us(partial(kernel.fn, qh, pool_h, idx, scale, D_V)))
        rtt[f"kernel_h{heads}_us"] = kt
        b = await breakdown(address, CORPUS, qh.cpu(), idx.cpu(), scale, 10 if quick else 20)
        rtt[f"grpc_breakdown_h{heads}"] = b
        rtt[f"grpc_attend_h{heads}"] = {
            "p50": b["requester_ms_p50"]["wall"] * 1e3,
            "holder_compute_p50": b["holder_stage_ms_mean"]["compute"] * 1e3,
        }
        print(f"gRPC after join h={heads}: {json.dumps(b)}", flush=True)
        budget = kt + 1.5 * rtt[f"echo_h{heads}"]["p50"]
        rtt[f"target_h{heads}_us"] = budget
        print(
            f"route h={heads}: echo {rtt[f'echo_h{heads}']['p50']:.1f} us "
            f"({qb / 1e6:.2f} MB out, {rb / 1e6:.2f} MB back), kernel {kt:.1f} us, "
            f"nvshmem attend put {rtt[f'nvshmem_put_attend_h{heads}']['p50']:.1f} us, direct "
            f"{rtt[f'nvshmem_direct_attend_h{heads}']['p50']:.1f} us "
            f"(target ≤ {budget:.1f}), grpc attend {rtt[f'grpc_attend_h{heads}']['p50']:.1f} us",
            flush=True,
        )
    out["route"] = rtt
    checkpoint(out)
    if not quick:
        out["kernel_choice"] = part_choice(dev)
        checkpoint(out)

    # (3) route vs fetch vs local per chunk
    local_fn = REGISTRY["flashmla"].fn if REGISTRY["flashmla"].available(str(dev)) else auto.fn
    cross = []
    q = torch.randn(n, h, D, generator=g, device=dev, dtype=torch.bfloat16)
    creps = max(10, reps // 4)
    for chunk in (64, 256, 1024, 4096, 16384, 65536):
        topk = max(128, min(K, chunk))  # the chunk's share of a row's top-k
        idx_c = corpus_rows(g, n, topk, chunk, dev)  # rows 0..chunk-1: the chunk's tokens
        await nv.open_stream("attend", creps + 3, n, h, topk, CORPUS, 0, 1, scale)
        times = []
        for i in range(creps + 3):
            t = time.perf_counter()
            nv.attend(q, idx_c).result()
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e6)
        route = med(times)
        rows = torch.arange(chunk, dtype=torch.int32, device=dev)
        await nv.open_stream("fetch", creps + 3, chunk, corpus_id=CORPUS)
        times = []
        for i in range(creps + 3):
            t = time.perf_counter()
            (pages,) = nv.fetch(rows).result()
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e6)
        fetch_rtt = med(times)
        # after a fetch (or a local re-prefill) the requester runs the partial itself
        splice = med(graph_us(partial(local_fn, q, pages, idx_c, scale, D_V)))
        fetch = fetch_rtt + splice
        # local: re-prefill the chunk through one layer's active parameters, at the bf16 rate
        # this GPU reaches for that many rows (a lower bound: no attention, no MoE imbalance)
        m = max(chunk, 64)
        a = torch.randn(m, 7168, device=dev, dtype=torch.bfloat16)
        w = torch.randn(7168, 7168, device=dev, dtype=torch.bfloat16)
        gemm_us = med(graph_us(partial(torch.matmul, a, w), 4, 10))
        rate = 2 * m * 7168 * 7168 / (gemm_us * 1e-6)
        local = 2 * chunk * LAYER_PARAMS / rate * 1e6 + splice
        best = min(("route", route), ("fetch", fetch), ("local", local), key=lambda x: x[1])[0]
        cross.append(
            {
                "chunk_tokens": chunk,
                "topk": topk,
                "route_us": route,
                "fetch_us": fetch,
                "fetch_rtt_us": fetch_rtt,
                "splice_kernel_us": splice,
                "local_us": local,
                "fetch_bytes": chunk * D * 2,
                "route_bytes": nr.attend_request_bytes(n, h, topk) + nr.attend_reply_bytes(n, h),
                "best": best,
            }
        )
        print(
            f"chunk {chunk:6d} (k {topk:4d}): route {route:8.1f} us  fetch {fetch:8.1f} us "
            f"(rtt {fetch_rtt:.1f} + kernel {splice:.1f})  local {local:9.1f} us  → {best}",
            flush=True,
        )
    out["crossover"] = {"rows": n, "heads": h, "k": K, "points": cross}
    checkpoint(out)

    out["decode_step"] = await decode_step(nv, g, dev, pool_h, local_fn, h, scale, reps)
    checkpoint(out)
    out["route_graphed"] = await graphed_route(nv, g, idx, reps, scale, rtt)
    await grpc_client.close()
    stop_holder()  # its endpoint closes the job: a collective barrier with ours
    await nv.close()
    return out


def graphed_step(
    send: Callable[[], Any], g_local: torch.cuda.CUDAGraph, lo_s: Any, depth: int, reps: int
) -> tuple[dict[str, float], Any]:
    """The distributed step with the local partial and the merge as graph replays: ``send()``
    starts the remote half (returns the route's Pending), one merge graph is captured per ring
    slot its reply can land in, then ``reps`` timed steps after 5 discarded. Returns the wall
    times' stats and the last merged (O, LSE)."""
    cur = torch.cuda.current_stream()
    merges = merge_graphs(send, g_local, lo_s, depth)
    times = []
    merged = None
    for i in range(reps + 5):
        t = time.perf_counter()
        pend = send()
        g_local.replay()
        ro, _ = pend.wait_on(cur)
        g_merge, merged = merges[ro.data_ptr()]
        g_merge.replay()
        torch.cuda.synchronize()
        pend.check()
        if i >= 5:
            times.append((time.perf_counter() - t) * 1e6)
    return stats(times), merged


def merge_graphs(
    send: Callable[[], Any], g_local: torch.cuda.CUDAGraph, lo_s: Any, depth: int
) -> dict[int, Any]:
    """One captured merge of the local partial with each ring slot's reply, keyed by the reply
    O's address: ``depth`` steps sent and waited for, eagerly."""
    from corpusd.kernels.merge import merge_partials

    merges = {}
    for _ in range(depth):
        pend = send()
        g_local.replay()
        ro, rl = pend.result()
        merges[ro.data_ptr()] = capture(partial(merge_partials, [lo_s, (ro, rl)]))
    return merges


def step_phases(
    send: Callable[[], Any], g_local: torch.cuda.CUDAGraph, lo_s: Any, depth: int, reps: int
) -> dict[str, float]:  # fmt: skip
    """Where one graphed step's time goes on the requester's stream: CUDA events between the
    parts of :func:`graphed_step`'s step (``reps`` after 5 discarded; p50 µs each): ``send``
    (the request's store and signal, or its host enqueue's device work), ``local`` (the local
    partial), ``wait`` (the stream idle until the holder's reply signal, after the local
    partial), ``merge``; and ``host_enqueue`` (host µs from the step's start to the merge's
    launch). The holder's own body time is in the JSON's ``holder_streams``."""
    cur = torch.cuda.current_stream()
    merges = merge_graphs(send, g_local, lo_s, depth)
    parts: dict[str, list[float]] = {k: [] for k in ("send", "local", "wait", "merge")}
    host = []
    for i in range(reps + 5):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        t = time.perf_counter()
        ev[0].record(cur)
        pend = send()
        ev[1].record(cur)
        g_local.replay()
        ev[2].record(cur)
        ro, _ = pend.wait_on(cur)
        ev[3].record(cur)
        merges[ro.data_ptr()][0].replay()
        host_us = (time.perf_counter() - t) * 1e6
        ev[4].record(cur)
        torch.cuda.synchronize()
        pend.check()
        if i >= 5:
            host.append(host_us)
            for k, (a, b) in zip(parts, pairwise(ev), strict=True):
                parts[k].append(a.elapsed_time(b) * 1e3)
    out = {k: stats(v)["p50"] for k, v in parts.items()}
    out["host_enqueue"] = stats(host)["p50"]
    return out


async def decode_step(
    nv: Any, g: torch.Generator, dev: torch.device, pool_h: torch.Tensor, local_fn: Any,
    h: int, scale: float, reps: int, agents: int = 32,
) -> dict[str, Any]:  # fmt: skip
    """(4) One distributed decode step (``agents`` rows, the corpus's first half on this GPU, the
    second on the holder's) against one monolithic call over the whole corpus, per layer: eager;
    graphed with the request sent eagerly (local partial and merge replayed); and graphed
    throughout (the route's store / signal / wait replayed as :class:`GraphedAttend`, direct
    mode, beside the local partial's replay), the step the decode worker can run."""
    from corpusd.kernels.merge import merge_partials

    gl = torch.Generator(device=dev).manual_seed(13)
    pool_local = torch.randn(HOLDER_TOKENS, D, generator=gl, device=dev, dtype=torch.bfloat16)
    pool_all = torch.cat([pool_local, pool_h])  # positions 0..128k local, 128k..256k remote
    qa = torch.randn(agents, h, D, generator=g, device=dev, dtype=torch.bfloat16)
    sel = corpus_rows(g, agents, K, 2 * HOLDER_TOKENS, dev)  # global top-k positions
    is_local = sel < HOLDER_TOKENS
    idx_local = torch.where(is_local, sel, -1)
    idx_remote = torch.where(~is_local & (sel >= 0), sel - HOLDER_TOKENS, -1)
    mono_fn = local_fn
    ref = mono_fn(qa, pool_all, sel, scale, D_V)
    await nv.open_stream("attend", reps + 6, agents, h, K, CORPUS, 0, 1, scale)
    pend = nv.attend(qa, idx_remote)
    lo = local_fn(qa, pool_local, idx_local, scale, D_V)
    ro, rl = pend.result()
    mo, ml = merge_partials([lo, (ro, rl)])
    dist_rel = float((mo.float() - ref[0].float()).norm() / ref[0].float().norm())
    dist_lse = float((ml - ref[1]).abs().max())
    times = []
    for i in range(reps + 5):
        t = time.perf_counter()
        pend = nv.attend(qa, idx_remote)
        lo = local_fn(qa, pool_local, idx_local, scale, D_V)
        ro, rl = pend.result()
        mo, ml = merge_partials([lo, (ro, rl)])
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t) * 1e6)
    dist = stats(times)
    times = []
    for i in range(reps + 5):
        t = time.perf_counter()
        mono_fn(qa, pool_all, sel, scale, D_V)
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t) * 1e6)
    mono = stats(times)
    mono_dev = med(graph_us(partial(mono_fn, qa, pool_all, sel, scale, D_V)))

    # The same step with the requester's local partial and merge as CUDA graphs (the decode
    # worker's steady state): host cost is one attend enqueue and two replays.
    g_local, lo_s = capture(partial(local_fn, qa, pool_local, idx_local, scale, D_V))
    depth = nv.ring.depth
    await nv.open_stream("attend", reps + 5 + depth, agents, h, K, CORPUS, 0, 1, scale)
    dist_graph, merged = graphed_step(lambda: nv.attend(qa, idx_remote), g_local, lo_s, depth, reps)
    graph_equal = bool(torch.equal(merged[0], mo) and torch.equal(merged[1], ml))
    await nv.open_stream("attend", reps + 5 + depth, agents, h, K, CORPUS, 0, 1, scale)
    phases = step_phases(lambda: nv.attend(qa, idx_remote), g_local, lo_s, depth, reps)
    # graphed throughout: no host enqueue of the request (direct: SM stores into its ring slot)
    await nv.open_stream("attend", reps + 5 + depth, agents, h, K, CORPUS, 0, 1, scale,
                         direct=True)  # fmt: skip
    dist_all, merged_all = graphed_step(nv.graphed(qa, idx_remote), g_local, lo_s, depth, reps)
    all_equal = bool(torch.equal(merged_all[0], mo) and torch.equal(merged_all[1], ml))
    await nv.open_stream("attend", reps + 5 + depth, agents, h, K, CORPUS, 0, 1, scale,
                         direct=True)  # fmt: skip
    phases_all = step_phases(nv.graphed(qa, idx_remote), g_local, lo_s, depth, reps)
    # the same, the reply waited for on this stream after the local partial (not inside the
    # send's graph, where it may hold this stream's local partial back: the 157 µs stall)
    await nv.open_stream("attend", 2 * (reps + 5 + depth), agents, h, K, CORPUS, 0, 1, scale,
                         direct=True)  # fmt: skip
    deferred = nv.graphed(qa, idx_remote, wait=False)
    dist_def, merged_def = graphed_step(deferred, g_local, lo_s, depth, reps)
    def_equal = bool(torch.equal(merged_def[0], mo) and torch.equal(merged_def[1], ml))
    phases_def = step_phases(deferred, g_local, lo_s, depth, reps)
    g_mono, _ = capture(partial(mono_fn, qa, pool_all, sel, scale, D_V))
    mono_graph = replay_wall(g_mono.replay, reps)
    mono_split = monolithic_split(qa, pool_all, sel, scale, ref, reps)
    split = await compacted_step(nv, qa, pool_local, idx_local, idx_remote, g_local, scale, reps,
                                 ref)  # fmt: skip
    layers, idx_bytes = 61, 128  # V3.2: 61 layers; index keys 128 fp8 bytes per token
    corpus_tokens = 2 * HOLDER_TOKENS
    per_token = layers * (D * 2 + idx_bytes)
    res = {
        "agents": agents,
        "corpus_tokens": corpus_tokens,
        "heads": h,
        "k": K,
        "distributed_wall_us": dist,
        "monolithic_wall_us": mono,
        "monolithic_device_us": mono_dev,
        "ratio_p50": dist["p50"] / mono["p50"],
        "distributed_graphed_wall_us": dist_graph,
        "monolithic_graphed_wall_us": mono_graph,
        "monolithic_split_graphed": mono_split,
        "ratio_graphed_p50": dist_graph["p50"] / mono_graph["p50"],
        "distributed_graphed_send_wall_us": dist_all,
        "ratio_graphed_send_p50": dist_all["p50"] / mono_graph["p50"],
        "graphed_send_equals_eager_bitwise": all_equal,
        "graphed_step_phases_us": phases,
        "graphed_send_step_phases_us": phases_all,
        "distributed_graphed_deferred_wait_wall_us": dist_def,
        "ratio_graphed_deferred_wait_p50": dist_def["p50"] / mono_graph["p50"],
        "graphed_deferred_wait_equals_eager_bitwise": def_equal,
        "graphed_deferred_wait_step_phases_us": phases_def,
        "compacted": split,
        "ratio_compacted_p50": split["step_wall_us"]["p50"] / mono_graph["p50"],
        "graphed_equals_eager_bitwise": graph_equal,
        "distributed_rel_err_vs_monolithic": dist_rel,
        "distributed_max_lse_diff": dist_lse,
        "capacity_bytes_per_gpu": {
            "monolithic": corpus_tokens * per_token,
            "distributed_2gpu": corpus_tokens * per_token // 2,
        },
        "note": "per layer; bf16 latent + fp8 index keys for 61 layers in the capacity numbers",
    }
    print(
        f"decode step ({agents} agents, 256k tokens, per layer): distributed {dist['p50']:.1f} us, "
        f"monolithic {mono['p50']:.1f} us wall / {mono_dev:.1f} us device, ratio "
        f"{dist['p50'] / mono['p50']:.2f}; graphed: distributed {dist_graph['p50']:.1f} us, "
        f"monolithic {mono_graph['p50']:.1f} us, ratio "
        f"{dist_graph['p50'] / mono_graph['p50']:.2f}; graphed send too {dist_all['p50']:.1f} "
        f"us, ratio {dist_all['p50'] / mono_graph['p50']:.2f}; merge vs monolithic rel err "
        f"{dist_rel:.1e}",
        flush=True,
    )
    print(f"graphed step's phases (requester's stream, p50 us): {phases}; with the send "
          f"graphed: {phases_all}", flush=True)  # fmt: skip
    print(f"graphed send, reply waited for after the local partial: {dist_def['p50']:.1f} us, "
          f"ratio {res['ratio_graphed_deferred_wait_p50']:.2f}, bit-equal {def_equal}; phases "
          f"{phases_def}", flush=True)  # fmt: skip
    print(
        f"compacted split (both halves valid-first, {split['kernel']}): step "
        f"{split['step_wall_us']['p50']:.1f} us, ratio {res['ratio_compacted_p50']:.2f}; alone: "
        f"local {split['local_alone_wall_us']['p50']:.1f} us (compacting both halves "
        f"{split['compact_alone_wall_us']['p50']:.1f}, the kernel told the counts "
        f"{split['local_kernel_alone_wall_us']['p50']:.1f}; uncompacted "
        f"{split['local_uncompacted_alone_wall_us']['p50']:.1f}), remote round trip "
        f"{split['remote_alone_wall_us']['p50']:.1f} us; rel err "
        f"{split['rel_err_vs_monolithic']:.1e}",
        flush=True,
    )  # fmt: skip
    return res


def replay_wall(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """Wall µs of ``fn()`` + a device sync, ``reps`` times after 5 discarded."""
    times = []
    for i in range(reps + 5):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t) * 1e6)
    return stats(times)


async def compacted_step(
    nv: Any, qa: torch.Tensor, pool_local: torch.Tensor, idx_local: torch.Tensor,
    idx_remote: torch.Tensor, g_local: torch.cuda.CUDAGraph, scale: float, reps: int,
    ref: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:  # fmt: skip
    """(4) as a graphed decode step can split the work: each half's indices compacted (valid
    first, -1 after, the same width; ``formats.valid_first``, in a graph), both halves attended
    by the kernel that walks only the valid ones (FlashMLA told each row's count,
    ``registry.FLASHMLA_LENGTHS``; the holder is told by ``OpenStream(compacted=True)`` and
    runs ``registry.for_compacted`` of its kernel). Also each part
    alone, to place the step's time: the local partial (compacted, and the uncompacted one of
    the other variants) and the remote round trip (send, holder's partial, reply)."""
    from corpusd.kernels.formats import valid_first
    from corpusd.kernels.registry import FLASHMLA_LENGTHS

    skip = FLASHMLA_LENGTHS
    lc, rc = torch.empty_like(idx_local), torch.empty_like(idx_remote)

    def compact() -> None:
        lc.copy_(valid_first(idx_local))
        rc.copy_(valid_first(idx_remote))

    g_compact, _ = capture(compact)
    g_local_c, lo_c = capture(partial(skip.fn, qa, pool_local, lc, scale, D_V))
    depth = nv.ring.depth
    agents, h = qa.shape[0], qa.shape[1]
    await nv.open_stream("attend", 2 * (reps + 5) + depth, agents, h, K, CORPUS, 0, 1, scale,
                         direct=True, compacted=True)  # fmt: skip
    send_c = nv.graphed(qa, rc)

    def send() -> Any:
        g_compact.replay()
        return send_c()

    step, merged = graphed_step(send, g_local_c, lo_c, depth, reps)
    cur = torch.cuda.current_stream()

    def remote() -> None:
        pend = send()
        pend.wait_on(cur)
        torch.cuda.synchronize()
        pend.check()

    def local() -> None:
        g_compact.replay()
        g_local_c.replay()

    remote_alone = replay_wall(remote, reps)
    return {
        "kernel": skip.name,
        "step_wall_us": step,
        "local_alone_wall_us": replay_wall(local, reps),
        "compact_alone_wall_us": replay_wall(g_compact.replay, reps),
        "local_kernel_alone_wall_us": replay_wall(g_local_c.replay, reps),
        "local_uncompacted_alone_wall_us": replay_wall(g_local.replay, reps),
        "remote_alone_wall_us": remote_alone,
        "valid_per_row_local": float((idx_local >= 0).sum(1).float().mean()),
        "valid_per_row_remote": float((idx_remote >= 0).sum(1).float().mean()),
        "rel_err_vs_monolithic": float(
            (merged[0].float() - ref[0].float()).norm() / ref[0].float().norm()
        ),
        "max_lse_diff_vs_monolithic": float((merged[1] - ref[1]).abs().max()),
    }


async def graphed_route(
    nv: Any, g: torch.Generator, idx: torch.Tensor, reps: int, scale: float, rtt: dict[str, Any]
) -> dict[str, Any]:
    """(2c) The route with the requester's store + signal + wait + status copy captured as one
    CUDA graph per ring slot (``NvshmemClient.graphed``), against the eager route above and the
    target (kernel + 1.5 × echo); the graph's reply must equal the eager one bit for bit."""
    dev = idx.device
    n = idx.shape[0]
    res: dict[str, Any] = {}
    for heads in (16, 128):
        qh = torch.randn(n, heads, D, generator=g, device=dev, dtype=torch.bfloat16)
        for direct in (False, True):
            mode = "direct" if direct else "put"
            await nv.open_stream("attend", 1, n, heads, K, CORPUS, 0, 1, scale, direct=direct)
            ref = nv.attend(qh, idx).result(copy=True)
            await nv.open_stream(
                "attend", reps + 6, n, heads, K, CORPUS, 0, 1, scale, direct=direct
            )
            try:
                send = nv.graphed(qh, idx)
            except Exception as e:  # the stream's requests still have to go out
                res["capture_error"] = f"{type(e).__name__}: {e}"
                print(f"graph capture failed: {res['capture_error']}", flush=True)
                for _ in range(reps + 6):
                    nv.attend(qh, idx).result()
                return res
            first = send().result(copy=True)
            equal = all(torch.equal(a, b) for a, b in zip(first, ref, strict=True))
            times = []
            for i in range(reps + 5):
                t = time.perf_counter()
                send().result()
                if i >= 5:
                    times.append((time.perf_counter() - t) * 1e6)
            key = f"nvshmem_{mode}_graph_attend_h{heads}"
            res[key] = {**stats(times), "equals_eager_bitwise": equal}
            print(
                f"graphed route {mode} h={heads}: p50 {res[key]['p50']:.1f} us (eager "
                f"{rtt[f'nvshmem_{mode}_attend_h{heads}']['p50']:.1f}, target "
                f"{rtt[f'target_h{heads}_us']:.1f}), equals eager: {equal}",
                flush=True,
            )
    return res


def part_choice(dev: torch.device, pool_tokens: int = 1 << 18) -> dict[str, Any]:
    """Both GPU kernels at few rows (1…64) and 16/64/128 heads, k 2048: device µs per call, the
    one ``corpusd.kernels.registry.prefer_triton`` picks, and its regret (picked / faster). A
    check of the rule (derived from ``tools/bench_gpu.py single``) on this run's GPU, where
    h = 128 below 38 rows was never measured before."""
    from corpusd.kernels.registry import REGISTRY, prefer_triton

    pool = random_pool(pool_tokens, dev, seed=3)
    g = torch.Generator(device=dev).manual_seed(4)
    points = []
    for h in (16, 64, 128):
        for rows in (1, 2, 4, 8, 16, 32, 64):
            q, idx = random_request(g, rows, h, K, pool_tokens, dev)
            t = {
                name: med(graph_us(partial(REGISTRY[name].fn, q, pool, idx, D**-0.5, D_V)))
                for name in ("flashmla", "triton")
            }
            pick = "triton" if prefer_triton(rows, h) else "flashmla"
            points.append({"rows": rows, "heads": h, **t, "picked": pick,
                           "regret": t[pick] / min(t.values())})  # fmt: skip
    worst = max(points, key=lambda p: p["regret"])
    print(f"kernel choice: worst regret {worst['regret']:.2f} at {worst['rows']} rows × "
          f"{worst['heads']} heads", flush=True)  # fmt: skip
    return {"k": K, "pool_tokens": pool_tokens, "points": points}


def monolithic_split(
    qa: torch.Tensor, pool: torch.Tensor, sel: torch.Tensor, scale: float,
    ref: tuple[torch.Tensor, torch.Tensor], reps: int,
) -> dict[str, Any]:  # fmt: skip
    """The monolithic partial with each row's 2,048 indices cut into 2 and 4 chunks, each its
    own FlashMLA query row, merged by LSE (``flashmla.split_sparse_partial``, the SGLang
    plugin's kernel): at 32 rows FlashMLA runs one CTA per row and 64 heads, so chunks fill the
    SMs the plain call leaves idle. Graphed wall p50 and the error against the plain call, per
    chunk count; an error string where the kernel build refuses it."""
    from corpusd.kernels import flashmla

    out: dict[str, Any] = {}
    try:
        base2 = flashmla.sparse_lse_base2(str(qa.device))
        for splits in (2, 4):
            fn = partial(flashmla.split_sparse_partial, qa, pool, sel, scale, D_V, base2, splits)
            g, (o, lse) = capture(fn)
            out[str(splits)] = {
                **replay_wall(g.replay, reps),
                "rel_err_vs_plain": float(
                    (o.float() - ref[0].float()).norm() / ref[0].float().norm()
                ),
                "max_lse_diff_vs_plain": float((lse - ref[1]).abs().max()),
            }
    except Exception as e:  # a bench variant: recorded, the rest still runs
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def print_agents_sweep(by_agents: dict[str, dict[str, Any]]) -> None:
    """The sweep's table: per agents count, monolithic and the distributed variants (graphed
    wall p50, µs) and their ratios."""
    print("agents  monolithic  split 2  split 4  distributed  deferred wait  ratio  deferred ratio")
    for agents, r in by_agents.items():
        ms = r["monolithic_split_graphed"]
        s2, s4 = (ms[s]["p50"] if s in ms else math.nan for s in ("2", "4"))
        print(f"{agents:>6} {r['monolithic_graphed_wall_us']['p50']:11.1f} {s2:8.1f} {s4:8.1f} "
              f"{r['distributed_graphed_wall_us']['p50']:12.1f} "
              f"{r['distributed_graphed_deferred_wait_wall_us']['p50']:14.1f} "
              f"{r['ratio_graphed_p50']:6.2f} {r['ratio_graphed_deferred_wait_p50']:15.2f}",
              flush=True)  # fmt: skip


def pair(
    out: Path, quick: bool, step_only: bool = False, step_agents: tuple[int, ...] = (32,)
) -> None:
    assert torch.cuda.device_count() >= 2, "the pair bench needs two GPUs"
    nv_env()
    port_file = Path(tempfile.mkdtemp(prefix="bench-pair-")) / "port"
    # The holder sees only GPU 1 (as its cuda:0), so every thread of it (gRPC flows, NVSHMEM
    # enqueue threads) launches on its GPU without per-thread device guards.
    holder = subprocess.Popen(
        [sys.executable, "-m", "tools.bench_gpu", "pair-holder", "--port-file", str(port_file),
         "--device", "0", "--rows", str(max(64, *step_agents))],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip
    try:
        deadline = time.time() + 180
        while not port_file.exists() or not port_file.read_text().strip():
            if holder.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"holder process did not come up (exit {holder.poll()})")
            time.sleep(0.2)
        port, kname = port_file.read_text().split()
        dev = torch.device("cuda", 0)
        result: dict[str, Any] = {
            "command": command(),
            "env": env_info(dev),
            "gpus": torch.cuda.device_count(),
        }

        def checkpoint(part: dict[str, Any]) -> None:  # a crash later keeps what was measured
            save(out, {**result, **part, "partial": True})

        result.update(
            asyncio.run(
                requester_main(
                    f"127.0.0.1:{port}",
                    kname,
                    quick,
                    holder.terminate,
                    checkpoint,
                    step_only,
                    step_agents,
                )
            )
        )
        holder.wait(60)
        stats_file = port_file.with_suffix(".stats")
        if stats_file.exists():
            result["holder_streams"] = json.loads(stats_file.read_text())
        save(out, result)
    finally:
        holder.terminate()
        try:
            holder.wait(60)
        except subprocess.TimeoutExpired:
            holder.kill()
