"""Where a gRPC Attend's time goes on a GPU holder (part of ``python -m tools.bench_gpu pair``).

The bench's holder serves two generic methods beside Holder: ``/bench.Probe/Echo`` (the raw gRPC
floor: the request's bytes in, as many bytes back as asked, no protobuf, no tensors) and
``/bench.Probe/Stats`` (its ``corpusd_holder_attend_stage_seconds`` sums and counts, and facts
about its process). The requester times its own side of each Attend (encode, call, decode) and
takes the holder's stages (decode, queue, compute, encode) out of the call: the rest is the
transport, which the echo of the same bytes bounds from below.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from typing import Any

import grpc
import torch

ECHO, STATS = "/bench.Probe/Echo", "/bench.Probe/Stats"
_OPTS = [("grpc.max_receive_message_length", 1 << 28), ("grpc.max_send_message_length", 1 << 28)]


def _raw(b: bytes) -> bytes:
    return b


def process_facts() -> dict[str, Any]:
    """CPU facts of this process (NVSHMEM's init or a proxy thread could change them)."""
    return {
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "cpus": os.cpu_count(),
        "threads": threading.active_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": os.getloadavg()[0],
    }


def add_probe(server: grpc.aio.Server, svc: Any) -> None:
    """Serve Echo and Stats for the HolderService ``svc`` on ``server`` (bench holder only)."""

    async def echo(req: bytes, context: Any) -> bytes:
        return bytes(int.from_bytes(req[:8], "little"))

    async def stats(req: bytes, context: Any) -> bytes:
        out: dict[str, Any] = {"process": process_facts(), "stages": {}}
        for metric in svc.metrics.attend_stage.collect():
            for s in metric.samples:
                if s.name.endswith(("_sum", "_count")):
                    kind = s.name.rsplit("_", 1)[1]
                    out["stages"].setdefault(s.labels["stage"], {})[kind] = s.value
        return json.dumps(out).encode()

    handler = grpc.method_handlers_generic_handler(
        "bench.Probe",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo, _raw, _raw),
            "Stats": grpc.unary_unary_rpc_method_handler(stats, _raw, _raw),
        },
    )
    server.add_generic_rpc_handlers((handler,))


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


async def breakdown(
    address: str,
    corpus: str,
    q: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    reps: int,
) -> dict[str, Any]:
    """gRPC Attend of host tensors ``q`` / ``idx`` ``reps`` times (after 2 warm-ups): p50 ms of
    the requester's encode / call / decode and wall, the holder's mean stage ms over the same
    calls, the echo floor of the same bytes, and both processes' facts."""
    from corpusd.v1 import holder_pb2, holder_pb2_grpc
    from corpusd.wire import from_proto, to_proto

    channel = grpc.aio.insecure_channel(address, options=_OPTS)
    stub = holder_pb2_grpc.HolderStub(channel)
    echo = channel.unary_unary(ECHO, request_serializer=_raw, response_deserializer=_raw)
    stats = channel.unary_unary(STATS, request_serializer=_raw, response_deserializer=_raw)
    phases: dict[str, list[float]] = {"encode": [], "call": [], "decode": [], "wall": []}
    before: dict[str, Any] = {}
    back = 0
    for i in range(reps + 2):
        if i == 2:
            before = json.loads(await stats(b""))
        t0 = time.perf_counter()
        req = holder_pb2.AttendRequest(
            corpus_id=corpus, layer=0, q=to_proto(q), rows=to_proto(idx), scale=scale
        )
        t1 = time.perf_counter()
        r = await stub.Attend(req)
        t2 = time.perf_counter()
        o = from_proto(r.o, "o", dtypes=(q.dtype,), rank=3)
        lse = from_proto(r.lse, "lse", dtypes=(torch.float32,), rank=2)
        t3 = time.perf_counter()
        back = o.numel() * o.element_size() + lse.numel() * 4
        if i >= 2:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                phases[k].append(v * 1e3)
    after = json.loads(await stats(b""))
    holder = {
        stage: (v["sum"] - before["stages"].get(stage, {}).get("sum", 0.0))
        * 1e3
        / max(1.0, v["count"] - before["stages"].get(stage, {}).get("count", 0.0))
        for stage, v in after["stages"].items()
    }
    out_bytes = q.numel() * q.element_size() + idx.numel() * idx.element_size()
    ask = back.to_bytes(8, "little") + bytes(out_bytes - 8)  # the same bytes out and back
    echo_ms = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        await echo(ask)
        if i >= 2:
            echo_ms.append((time.perf_counter() - t0) * 1e3)
    await channel.close()
    call = _med(phases["call"])
    in_holder = sum(holder.values())
    return {
        "requester_ms_p50": {k: _med(v) for k, v in phases.items()},
        "holder_stage_ms_mean": holder,
        "call_minus_holder_ms": call - in_holder,
        "echo_same_bytes_ms_p50": _med(echo_ms),
        "bytes_out": out_bytes,
        "bytes_back": back,
        "holder_process": after["process"],
        "requester_process": process_facts(),
    }
