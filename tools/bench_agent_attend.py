"""The SGLang plugin's corpus call, hop by hop: where a routed layer's time goes.

    python -m tools.bench_agent_attend --device cuda:0 --out bench/results/agent-attend-h200.json

The same corpusd as ``tools/bench_sglang`` (coordinator, holders on ``--device``, one agent; the
sparse corpus pinned), then the plugin's call at its shapes (q ``[n, 64, 576]`` bf16, ``k`` 2048
canonical positions) timed three ways, ``n`` in ``--rows``:

- ``link``: ``CorpusLink.attend``, the synchronous call the plugin makes from SGLang's forward
  (its event-loop thread, then the holders straight, merged);
- ``agent``: ``requester.Client.attend``, the same through an agent worker (the Agent API; the
  plugin's path before, and its fallback when a holder call fails);
- ``holder``: ``HolderClient.attend`` straight to the holder, with positions turned into its
  pool rows (the holder hop alone), and the holder's own stage times
  (``corpusd_holder_attend_stage_seconds``: decode, queue, compute, encode).

The differences are the costs of each hop. Prints a table of medians and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.model import ModelConfig
from corpusd.model.checkpoint import fingerprint
from requester.client import Client
from requester.holder_client import HolderClient
from requester.sglang.link import CorpusLink
from tools.bench_sglang import REGIMES
from tools.sglang_server import start_corpusd

HEADS, WIDTH, K = 64, 576, 2048


def stage_sums(ports: list[int]) -> dict[str, tuple[float, float]]:
    """stage → (sum seconds, count) of the holders' ``attend_stage_seconds``."""
    text = ""
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text += r.read().decode()
    out: dict[str, tuple[float, float]] = {}
    for kind, stage, v in re.findall(
        r'^\w*attend_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text, re.M
    ):
        s, c = out.get(stage, (0.0, 0.0))
        out[stage] = (s + float(v), c) if kind == "sum" else (s, c + float(v))
    return out


async def timed(fn: Callable[[], Awaitable[Any]], reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        ts.append(time.perf_counter() - t0)
    return ts


def median_ms(ts: list[float], warm: int) -> float:
    return 1e3 * statistics.median(ts[warm:])


async def measure(
    a: argparse.Namespace, coordinator: str, model: Path, ports: list[int]
) -> dict[str, Any]:
    async with CoordinatorClient(coordinator) as cc:
        corpus = next(c for c in await cc.list_corpora() if c.name == "sparse")
        table = await cc.page_table(corpus.corpus_id)
    t = corpus.tokens
    # the holder with the most pages, and the positions it holds (the direct call's rows)
    holder_id = max(table.holders, key=lambda h: len(table.frames_on(h)))
    frames = table.frames_on(holder_id)
    page = table.corpus.page_size
    held = torch.tensor(
        [p * page + i for p in sorted(frames) for i in range(page) if p * page + i < t]
    )
    hc = HolderClient(table.address(holder_id))
    client = Client(coordinator=coordinator, timeout=60)
    link = CorpusLink(coordinator, ModelConfig.from_dir(model), fingerprint(model), page)
    binding = link.bind("sparse")
    g = torch.Generator().manual_seed(0)
    scale = ModelConfig.from_dir(model).softmax_scale
    rows_out = []

    async def one(n: int) -> dict[str, Any]:
        q = torch.randn(n, HEADS, WIDTH, generator=g).bfloat16()
        k = min(K, len(held))
        positions = torch.stack(
            [held[torch.randperm(len(held), generator=g)[:k]] for _ in range(n)]
        )
        pool = (positions // page).apply_(frames.__getitem__) * page + positions % page
        compute_us: list[float] = []

        async def direct() -> None:
            p = await hc.attend_rows(corpus.corpus_id, 0, q, pool, scale)
            compute_us.append(p.compute_us)

        def through_link() -> list[float]:  # synchronous, from a thread: as SGLang's forward
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                link.attend(binding, 0, q, positions, scale)
                ts.append(time.perf_counter() - t0)
            return ts

        before = stage_sums(ports)
        holder_ts = await timed(direct, a.reps)
        after = stage_sums(ports)
        agent_ts = await timed(lambda: client.attend("sparse", 0, q, positions=positions), a.reps)
        link_ts = await asyncio.to_thread(through_link)
        zero = (0.0, 0.0)
        return {
            "rows": n,
            "k": k,
            "link_ms": median_ms(link_ts, a.warm),
            "agent_ms": median_ms(agent_ts, a.warm),
            "holder_ms": median_ms(holder_ts, a.warm),
            "holder_compute_ms": statistics.median(compute_us[a.warm :]) / 1e3,
            "holder_stage_mean_ms": {
                s: 1e3
                * (after[s][0] - before.get(s, zero)[0])
                / max(1.0, after[s][1] - before.get(s, zero)[1])
                for s in after
            },
        }

    try:
        for n in a.rows:
            rows_out.append(await one(n))
            print(json.dumps(rows_out[-1]), flush=True)
    finally:
        await hc.close()
        await client.close()
        await asyncio.to_thread(link.close)
    return {"corpus_tokens": t, "heads": HEADS, "reps": a.reps, "warm": a.warm, "results": rows_out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/agent-attend-cpu.json")
    ap.add_argument("--work", default="/tmp/corpusd-bench-agent-attend")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--holders", type=int, default=2)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=3)
    a = ap.parse_args(argv)
    work = Path(a.work)
    model = work / "model"
    if not (model / "config.json").exists():
        import subprocess

        init = [sys.executable, "-m", "corpusd", "model", "init", str(model), "--preset", "sglang"]
        subprocess.run([*init, "--index-topk", "2048", "--index-arith", "fp8"], check=True)
    cd = start_corpusd(work, model, {"sparse": REGIMES["sparse"]}, a.holders, a.device)
    try:
        ports = [d.metrics_port for d in cd.daemons[1 : 1 + a.holders]]
        out = {"device": a.device, **asyncio.run(measure(a, cd.coordinator, model, ports))}
    finally:
        cd.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"{'rows':>4} {'link':>8} {'agent':>8} {'holder':>8} {'compute':>8}  ms (medians)")
    for r in out["results"]:
        print(
            f"{r['rows']:>4} {r['link_ms']:>8.2f} {r['agent_ms']:>8.2f} {r['holder_ms']:>8.2f} "
            f"{r['holder_compute_ms']:>8.2f}  stages {r['holder_stage_mean_ms']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
