"""Decode benchmark: per-step latency and tokens/s of N agents over one pinned corpus on 2 holders.

For each N, the same greedy decode runs with the primitive forced to route, fetch and local, with
the predicate free (auto), and as the monolithic baseline (the whole corpus cache read from the
page store into the requester process, attended locally, no holders). Every run decodes the
same tokens, so each (step, layer, holder) group is comparable across runs: "predicate right"
is the share of auto's decisions that picked the primitive whose forced run (route or fetch)
measured cheapest for that same group. ``local``'s one-off re-prefill of the corpus is the
pin's prefill of the same tokens with the same code (``prefill_seconds`` in the manifest); its
steps after that attend rows held here (preloaded from the store, not recomputed, to keep the
run short).

    python -m tools.bench_decode [--tokens 65536] [--agents 1 8 32] [--steps 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from corpusd.corpus.pin import PinConfig, pin
from corpusd.corpus.store import PageStore
from corpusd.model import load_model
from corpusd.model.tiny import init_tiny
from holder.launch import start_holder
from requester.calibrate import calibrate
from requester.config import WorkerConfig
from requester.holder_client import HolderClient
from requester.predicate import Profile
from requester.sampling import SamplingParams
from requester.sources import LocalRows
from requester.worker import Worker
from tools.bench_pin import make_corpus

MODES = ("monolithic", "route", "fetch", "local", "auto")


async def place(cid: str, addresses: list[str], n_pages: int, seed: int) -> None:
    rng = random.Random(seed)
    owners: list[list[int]] = [[] for _ in addresses]
    for page in range(n_pages):
        owners[rng.randrange(len(addresses))].append(page)
    for addr, pages in zip(addresses, owners, strict=True):
        c = HolderClient(addr)
        await c.assign(cid, pages)
        await c.close()


async def run_mode(
    model: Any,
    store: PageStore,
    cid: str,
    addresses: list[str],
    mode: str,
    n: int,
    steps: int,
    profile: Profile,
) -> dict[str, Any]:
    prim = {"monolithic": "local", "auto": "auto"}.get(mode, mode)
    w = Worker(model, WorkerConfig(primitive=prim, trace=True), store=store, profile=profile)
    try:
        if mode == "monolithic":
            w.attach_monolithic(cid)
        else:
            st = await w.attach(cid, addresses)
            if mode == "local":  # rows as the re-prefill leaves them (read, not recomputed)
                mono = Worker(model, store=store).attach_monolithic(cid)
                st.local = mono.local
                assert isinstance(st.local, LocalRows)
        sessions = [
            w.open(
                cid,
                list(f"\nQ{i}: explain line {i * 13}".encode()),
                params=SamplingParams(max_tokens=steps),
            )
            for i in range(n)
        ]
        times: list[float] = []
        t0 = time.perf_counter()
        async for _ in w.stream(sessions):
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
        decode = times[1:]  # times[0] is the prompts' prefill step
        med = statistics.median(decode)
        return {
            "mode": mode,
            "agents": n,
            "prefill_step_ms": times[0] * 1e3,
            "step_ms_median": med * 1e3,
            "step_ms_all": [t * 1e3 for t in decode],
            "tokens_per_s": n / med,
            "tokens": [s.generated for s in sessions],
            "trace": w.trace,
            "fetched_bytes": w.metrics.fetched_bytes._value.get(),
        }
    finally:
        await w.close()


def predicate_score(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Share of auto's group decisions that match the cheaper of the forced route and fetch runs
    for the same group. The forced local run is left out: its rows are preloaded (its one-off
    re-prefill is reported apart), so it does not start from the state auto starts from."""
    measured: dict[tuple[int, int, int], dict[str, float]] = {}
    for prim in ("route", "fetch"):
        for t in runs[prim]["trace"]:
            measured.setdefault((t["step"], t["layer"], t["holder"]), {})[prim] = t["measured_us"]
    right = total = 0
    picks: dict[str, int] = {}
    for t in runs["auto"]["trace"]:
        costs = measured.get((t["step"], t["layer"], t["holder"]))
        picks[t["pick"]] = picks.get(t["pick"], 0) + 1
        if costs and len(costs) == 2:
            total += 1
            right += t["pick"] == min(costs, key=lambda k: costs[k])
    return {
        "right": right,
        "total": total,
        "share": right / total if total else None,
        "picks": picks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--agents", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "corpusd-bench-decode"))
    p.add_argument("--out", default="bench/results/decode-cpu.json")
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    mdir = work / "model"
    if not (mdir / "config.json").exists():
        init_tiny(mdir, preset="sglang")  # byte tokens: the corpus sizes below are bytes
    src = work / f"corpus-{a.tokens}"
    if not src.exists():
        src.mkdir()
        make_corpus(src, a.tokens - 16)
    r = pin(
        PinConfig(
            corpus=str(src), model=str(mdir), store=str(work / "store"), max_tokens=a.tokens + 1024
        )
    )
    m = r.manifest
    cid, store = m.corpus_id, PageStore(work / "store")
    print(f"corpus {cid}: {m.token_count:,} tokens, prefill {m.prefill_seconds:.0f} s")
    model = load_model(mdir, dtype=torch.float32)
    holders = [
        start_holder(work / "store", work / f"holder{i}", mdir, "--threads", "1") for i in range(2)
    ]
    addresses = [h.address for h in holders]
    results: list[dict[str, Any]] = []
    scores: dict[int, Any] = {}
    try:
        for h in holders:  # fresh placement each run
            asyncio.run(_release(h.address, cid))
        profile = asyncio.run(_calibrate(model, store, cid, addresses[0]))
        profile.save(work / "profile.json")
        asyncio.run(_release(addresses[0], cid))
        asyncio.run(place(cid, addresses, m.n_pages, seed=0))
        for n in a.agents:
            runs = {}
            for mode in MODES:
                res = asyncio.run(run_mode(model, store, cid, addresses, mode, n, a.steps, profile))
                runs[mode] = res
                print(
                    f"N={n:3d} {mode:10s} step {res['step_ms_median']:8.1f} ms "
                    f"{res['tokens_per_s']:7.2f} tok/s  (prefill step "
                    f"{res['prefill_step_ms']:.0f} ms)"
                )
            ref = runs["monolithic"]["tokens"]
            for mode, res in runs.items():
                assert res["tokens"] == ref, f"N={n} {mode}: tokens differ from monolithic"
            scores[n] = predicate_score(runs)
            print(f"N={n:3d} predicate picked the cheapest: {scores[n]}")
            results += [{k: v for k, v in res.items() if k != "trace"} for res in runs.values()]
    finally:
        for h in holders:
            h.stop()
    out = {
        "bench": "decode",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "corpus_tokens": m.token_count,
        "reprefill_seconds_local": m.prefill_seconds,
        "holders": 2,
        "index_topk": model.cfg.index_topk,
        "steps": a.steps,
        "results": results,
        "predicate": scores,
        "profile": asdict(profile),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'N':>3} " + " ".join(f"{mode:>12}" for mode in MODES) + "   (ms per step)")
    for n in a.agents:
        row = {r["mode"]: r["step_ms_median"] for r in results if r["agents"] == n}
        print(f"{n:>3} " + " ".join(f"{row[mode]:12.1f}" for mode in MODES))
    print(f"local's one-off re-prefill: {m.prefill_seconds:.0f} s; wrote {a.out}")


async def _calibrate(model: Any, store: PageStore, cid: str, address: str) -> Profile:
    """Measure the predicate's constants in this run (holder 0 holding the whole corpus)."""
    c = HolderClient(address)
    try:
        await c.assign(cid)
        return await calibrate(model, c, cid, store.read_tokens(cid))
    finally:
        await c.close()


async def _release(address: str, cid: str) -> None:
    c = HolderClient(address)
    try:
        if cid in {x.corpus_id for x in (await c.info()).corpora}:
            await c.release(cid)
    finally:
        await c.close()


if __name__ == "__main__":
    main()
