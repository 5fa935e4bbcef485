"""The gRPC Attend path on CPU at the GPU bench's sizes: where a request's time goes, kernel aside.

    python -m tools.bench_grpc_attend --out bench/results/grpc-attend-cpu.json

A holder process serves a bf16 pool of 128k tokens (one layer) with a no-op kernel, so what is
timed is everything but the kernel: the requester's encode / call / decode, the holder's stages
(``attend_stage_seconds``) and a raw gRPC echo of the same bytes (``tools/bench_gpu_grpc.py``),
at 64 rows × k 2048 × 16 and 128 heads. Then, in this process, the host costs per request that a
GPU holder no longer pays (it checks q and the rows on the device): each read of a upb bytes
field (a copy), the bytearray copy, ``isfinite(q).all()`` against ``aminmax``, ``check_rows``,
and ``ByteSize()``. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TOKENS, PAGE, N, K = 1 << 17, 64, 64, 2048


def _pool() -> Any:
    from holder.pool import FramePool, Geometry

    pool = FramePool(Geometry(1, PAGE, 576, 128, torch.bfloat16, TOKENS // PAGE, d_v=512))
    pool.add_corpus("c", TOKENS, TOKENS // PAGE)
    for page, frame in enumerate(pool.take_frames(TOKENS // PAGE)):
        pool.valid[frame], pool.owner[frame] = PAGE, 0
        pool.corpora["c"].pages[page] = frame
    return pool


def holder_main(port_file: Path) -> None:
    """A CPU holder over ``_pool()`` with a no-op kernel, plus the bench probe methods."""
    import grpc

    from corpusd.corpus.store import PageStore
    from corpusd.kernels.registry import Kernel
    from corpusd.v1 import holder_pb2_grpc
    from holder.config import HolderConfig
    from holder.metrics import HolderMetrics
    from holder.service import HolderService
    from tools.bench_gpu_grpc import _OPTS, add_probe

    def no_op(
        q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q.new_zeros(q.shape[0], q.shape[1], d_v), torch.zeros(q.shape[:2])

    tmp = Path(tempfile.mkdtemp(prefix="bench-grpc-"))
    cfg = HolderConfig(store=str(tmp / "s"), state_dir=str(tmp / "t"), dtype="bfloat16",
                       capacity_tokens=TOKENS, max_rows=4096, metrics_port=-1)  # fmt: skip
    kernel = Kernel("no-op", no_op, lambda device: True, 0)
    svc = HolderService(cfg, _pool(), PageStore(cfg.store), kernel, "bench", HolderMetrics())

    async def serve() -> None:
        server = grpc.aio.server(options=_OPTS)
        holder_pb2_grpc.add_HolderServicer_to_server(svc, server)
        add_probe(server, svc)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_file.write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(serve())


def _ms(fn: Callable[[], Any], reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def host_costs(heads: int) -> dict[str, float]:
    """ms per request of each host step the old GPU Attend path took on its event loop."""
    from corpusd.v1 import holder_pb2
    from corpusd.wire import all_finite, to_proto

    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, heads, 576, generator=g).bfloat16()
    rows = torch.randint(0, TOKENS, (N, K), generator=g, dtype=torch.int32)
    req = holder_pb2.AttendRequest(corpus_id="c", q=to_proto(q), rows=to_proto(rows), scale=0.1)
    data = req.q.data
    pool = _pool()
    return {
        "read_bytes_field": _ms(lambda: req.q.data),
        "bytearray_copy": _ms(lambda: bytearray(data)),
        "isfinite_all": _ms(lambda: bool(torch.isfinite(q).all())),
        "aminmax_check": _ms(lambda: all_finite(q)),
        "check_rows": _ms(lambda: pool.check_rows("c", rows)),
        "request_ByteSize": _ms(req.ByteSize),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/grpc-attend-cpu.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--holder", type=Path, help=argparse.SUPPRESS)  # (internal) port file
    a = ap.parse_args()
    if a.holder:
        holder_main(a.holder)
        return
    from tools.bench_gpu_grpc import breakdown

    port_file = Path(tempfile.mkdtemp(prefix="bench-grpc-")) / "port"
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench_grpc_attend", "--holder",
                             str(port_file)])  # fmt: skip
    result: dict[str, Any] = {
        "command": "python -m tools.bench_grpc_attend " + " ".join(sys.argv[1:]),
        "cpus": torch.get_num_threads(),
        "rows": N,
        "k": K,
        "pool_tokens": TOKENS,
    }
    try:
        while not port_file.exists() or not port_file.read_text():
            assert proc.poll() is None, "holder process died"
            time.sleep(0.1)
        address = f"127.0.0.1:{port_file.read_text()}"
        for heads in (16, 128):
            g = torch.Generator().manual_seed(heads)
            q = torch.randn(N, heads, 576, generator=g).bfloat16()
            rows = torch.randint(0, TOKENS, (N, K), generator=g, dtype=torch.int32)
            b = asyncio.run(breakdown(address, "c", q, rows, 0.1, a.reps))
            result[f"h{heads}"] = {**b, "host_costs_ms": host_costs(heads)}
    finally:
        proc.terminate()
        proc.wait(30)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'heads':>5} {'wall':>7} {'call':>7} {'holder':>7} {'echo':>7}  host costs (ms)")
    for heads in (16, 128):
        r = result[f"h{heads}"]
        req = r["requester_ms_p50"]
        costs = ", ".join(f"{k} {v:.2f}" for k, v in r["host_costs_ms"].items())
        print(f"{heads:>5} {req['wall']:7.2f} {req['call']:7.2f} "
              f"{sum(r['holder_stage_ms_mean'].values()):7.2f} "
              f"{r['echo_same_bytes_ms_p50']:7.2f}  {costs}")  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
