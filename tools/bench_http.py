"""The OpenAI-compatible HTTP API against the gRPC Agent API on one agent worker: the same
sessions, the same tokens; what does HTTP (JSON, server-sent events, the ``openai`` client)
add to time to first token and between tokens?

    python -m tools.bench_http --out bench/results/http-cpu.json

Starts a coordinator, one holder and an agent (``--http-port 0``) on loopback with the tiny
model, publishes a probe corpus of random pages (``requester.calibrate.probe_corpus``; timings
do not depend on the values), then runs ``--rounds`` rounds of ``--agents`` concurrent greedy
streams of ``--tokens`` tokens, alternating gRPC (``requester.Client``) and HTTP (the official
``openai`` client, ``/v1/completions`` with ``stream``), each stream on the same prompt in both.
Checks the token ids are equal, prints a table of medians and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.model.tiny import init_tiny
from holder.launch import start_holder
from requester.calibrate import probe_corpus
from requester.client import Client
from requester.launch import start_agent


async def grpc_stream(address: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Token ids and the time of each (s since the call) of one greedy gRPC stream."""
    async with Client(agent=address) as c:
        t0 = time.perf_counter()
        s = await c.open_session("calibration-probe", prompt)
        ids: list[int] = []
        times: list[float] = []
        async for chunk in c.generate(s, max_tokens=n):
            ids += chunk.token_ids
            times.append(time.perf_counter() - t0)
        await c.close_session(s)
        return ids, times


async def http_stream(base: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    import openai

    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as c:
        t0 = time.perf_counter()
        stream = await c.completions.create(
            model="calibration-probe", prompt=prompt, max_tokens=n, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        ids, times = [], []
        async for chunk in stream:
            ids += (chunk.choices[0].model_extra or {})["token_ids"]
            times.append(time.perf_counter() - t0)
        return ids, times


def summary(runs: list[tuple[list[int], list[float]]]) -> dict[str, float]:
    ttft = [t[0] for _, t in runs]
    gaps = [b - a for _, t in runs for a, b in itertools.pairwise(t)]
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "inter_token_p50_ms": statistics.median(gaps) * 1e3,
        "wall_max_s": max(t[-1] for _, t in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    model = init_tiny(tmp / "tiny")
    store = tmp / "store"
    cid = probe_corpus(PageStore(store), model)
    coord = start_coordinator(tmp / "coord", store)
    holder = start_holder(store, tmp / "h0", model, "--coordinator", coord.address)
    agent = start_agent(
        store, tmp / "agent", model, "--coordinator", coord.address, "--http-port", "0",
        "--primitive", "route",
    )  # fmt: skip
    base = f"http://127.0.0.1:{agent.http_port}/v1"
    prompts = [list(f"\nQ{i}: what is on line {i * 41}?\nA:".encode()) for i in range(a.agents)]
    rows: dict[str, list[dict[str, float]]] = {"grpc": [], "http": []}
    try:

        async def go() -> None:
            async with CoordinatorClient(coord.address) as cc:
                await cc.wait_holders(1)
                await cc.pin(cid, replicas=1, wait=True, timeout=120)
            # bind the corpus once, outside the timings
            await grpc_stream(agent.address, prompts[0], 1)
            for _ in range(a.rounds):
                g = await asyncio.gather(
                    *(grpc_stream(agent.address, p, a.tokens) for p in prompts)
                )
                h = await asyncio.gather(*(http_stream(base, p, a.tokens) for p in prompts))
                assert [x[0] for x in g] == [x[0] for x in h], "HTTP and gRPC tokens differ"
                rows["grpc"].append(summary(list(g)))
                rows["http"].append(summary(list(h)))

        asyncio.run(go())
    finally:
        for d in (agent, holder, coord):
            d.stop()
    result: dict[str, Any] = {
        "agents": a.agents,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "same_tokens": True,
        "machine": f"{os.cpu_count()} CPUs; load average {load_before[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after",
        "medians": {
            api: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for api, runs in rows.items()
        },
        "rounds_detail": rows,
    }
    print(f"{a.agents} concurrent greedy streams of {a.tokens} tokens, {a.rounds} rounds each")
    print(f"{'api':6} {'TTFT p50 ms':>12} {'inter-token p50 ms':>19} {'wall s':>8}")
    for api, m in result["medians"].items():
        print(
            f"{api:6} {m['ttft_p50_ms']:12.1f} {m['inter_token_p50_ms']:19.1f} "
            f"{m['wall_max_s']:8.2f}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
