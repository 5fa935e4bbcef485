"""Requester side of ``tests/test_gpu_transport.py``'s live test, in its own process on GPU 0.

Two decode workers attach one corpus on one live ``corpusd holder --nvshmem-peers 1``: one forced
to gRPC, one forced to NVSHMEM. They must pick those transports, decode the same tokens with the
same logits, return the same partials bit for bit (the external ``attend`` path, at row counts
that run Triton and FlashMLA on the holder), and refuse rows outside the corpus with the same
status. Prints one JSON line, then leaves with ``os._exit``: the NVSHMEM job is abandoned, not
finalised (that is collective with the holder, which keeps serving).

    python tests/gpu/nvshmem_worker.py MODEL_DIR STORE CORPUS_ID HOLDER_ADDRESS
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from prometheus_client import generate_latest

from corpusd.corpus.store import PageStore
from corpusd.model import load_model
from corpusd.rpc import StatusError
from requester.config import WorkerConfig
from requester.sampling import SamplingParams
from requester.worker import Worker

PROMPTS = [f"\nQ{i}: line {i * 37}?" for i in range(4)]


async def main(model_dir: str, store_dir: str, cid: str, address: str) -> dict[str, Any]:
    model = load_model(Path(model_dir), dtype=torch.float32)
    store = PageStore(store_dir)
    out: dict[str, Any] = {}
    workers = {
        t: Worker(model, WorkerConfig(primitive="route", transport=t), store=store)
        for t in ("grpc", "nvshmem")
    }
    t0 = time.perf_counter()
    for w in workers.values():
        await w.attach(cid, [address])
    out["attach_s"] = time.perf_counter() - t0
    out["routes"] = {t: w.fanout.routes[address].name for t, w in workers.items()}

    got = {}
    for t, w in workers.items():
        sessions = [
            w.open(cid, list(p.encode()), params=SamplingParams(max_tokens=8), keep_logits=True)
            for p in PROMPTS
        ]
        t0 = time.perf_counter()
        await w.generate(sessions)
        out[f"generate_{t}_s"] = time.perf_counter() - t0
        got[t] = ([s.generated for s in sessions], [torch.stack(s.logits or []) for s in sessions])
    # a failed-over holder call recomputes locally: the same tokens, other bits
    out["holder_errors"] = {
        t: {
            m.labels["kind"]: m.value
            for f in w.metrics.errors.collect()
            for m in f.samples
            if m.name.endswith("_total") and m.value
        }
        for t, w in workers.items()
    }
    out["tokens"] = got["nvshmem"][0]
    out["tokens_equal"] = got["grpc"][0] == got["nvshmem"][0]
    out["logits_equal"] = all(
        torch.equal(a, b) for a, b in zip(got["grpc"][1], got["nvshmem"][1], strict=True)
    )

    # partials, through the path external engines use; 1 and 7 rows run Triton on the holder
    # (64 heads, < 16 rows), 40 rows FlashMLA
    g = torch.Generator().manual_seed(7)
    tokens = store.manifest(cid).token_count
    equal, lat = [], {}
    for n in (1, 7, 40):
        for layer in (0, 1):
            q = torch.randn(n, 64, 576, generator=g)
            pos = torch.randint(0, tokens, (n, 128), generator=g)
            pos[0, 100:] = -1
            a = await workers["grpc"].attend(cid, layer, q, positions=pos)
            b = await workers["nvshmem"].attend(cid, layer, q, positions=pos)
            equal.append(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    out["partials_equal"] = equal

    # one holder call per transport, 7 rows × 64 heads × k 128 (informational)
    q = torch.randn(7, 64, 576, generator=g)
    rows = torch.randint(0, tokens, (7, 128), generator=g)  # the corpus fills frames 0.. first
    scale = model.cfg.softmax_scale
    for t, w in workers.items():
        route = w.fanout.routes[address]
        times = []
        for i in range(23):
            t0 = time.perf_counter()
            await route.attend_rows(cid, 0, q, rows, scale)
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e6)
        lat[t] = statistics.median(times)
    out["route_call_us_7x64x128"] = lat

    bad = rows.clone()
    bad[3, 5] = 4000  # a pool row past the corpus (capacity 4096 tokens, corpus ~700)
    codes = {}
    for t, w in workers.items():
        try:
            await w.fanout.routes[address].attend_rows(cid, 0, q, bad, scale)
            codes[t] = "OK"
        except grpc.aio.AioRpcError as e:
            codes[t] = e.code().name
        except StatusError as e:
            codes[t] = e.code.name
    out["bad_rows"] = codes
    text = generate_latest(workers["nvshmem"].metrics.registry).decode()
    line = f'corpusd_requester_transport_info{{holder="{address}",transport="nvshmem"}} 1.0'
    out["metric_exported"] = line in text
    return out


if __name__ == "__main__":
    result = asyncio.run(main(*sys.argv[1:5]))
    print(json.dumps(result), flush=True)
    os._exit(0)  # leave the NVSHMEM job abandoned: finalising is collective with the holder
