"""``corpusd agents``: N sub-agents with different questions over one pinned corpus, through
the Agent API — their answers, a latency table and where to scrape the metrics.

The tiny default model has random weights, so its answers are noise; what this shows is one
corpus prefilled once and forked by every agent, decoded concurrently (one batch on the
worker), with attention over the corpus routed to the holders and merged exactly.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from corpusd.coordinator.client import CoordinatorClient
from corpusd.env import running_up
from corpusd.model.tiny import TINY_FINGERPRINTS
from requester.ask import PROMPT
from requester.client import Client, SessionRef

QUESTIONS = (
    "What does env.py declare?",
    "Where is the page store kept?",
    "How does the progress bar print?",
    "What is in a manifest?",
    "Which file renders the page layout?",
    "What is CORPUSD_HOME?",
    "How are corpus ids made?",
    "What is the token stream of a corpus?",
)


@dataclass
class Run:
    question: str
    session: SessionRef
    text: str = ""
    tokens: int = 0
    finish: str = ""
    opened_s: float = 0.0
    first_s: float = 0.0
    gaps: list[float] = field(default_factory=list)


async def _one(c: Client, corpus: str, question: str, max_tokens: int, t0: float) -> Run:
    s = await c.open_session(corpus, PROMPT.format(question=question), reserve_tokens=max_tokens)
    r = Run(question, s, opened_s=time.perf_counter() - t0)
    last = time.perf_counter()
    async for chunk in c.generate(s, max_tokens=max_tokens):
        now = time.perf_counter()
        if r.tokens == 0:
            r.first_s = now - t0
        else:
            r.gaps.append(now - last)
        last = now
        r.tokens += len(chunk.token_ids)
        r.text += chunk.text
        r.finish = chunk.finish_reason or r.finish
    await c.close_session(s)
    return r


async def run_agents(coordinator: str, corpus: str, agents: int, max_tokens: int) -> str:
    """Open ``agents`` sessions at once, stream them all, and render the report."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(agents)]
    async with Client(coordinator=coordinator) as c:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(_one(c, corpus, q, max_tokens, t0) for q in questions))
        wall = time.perf_counter() - t0
    async with CoordinatorClient(coordinator) as cc:
        holders, workers = await cc.list_holders(), await cc.list_workers()
        corpora = {x.corpus_id: x for x in await cc.list_corpora()}
    lines = [
        f"{agents} sub-agents over corpus {corpus!r} ({runs[0].session.corpus_tokens:,} tokens)",
        "",
    ]
    pinned = corpora.get(runs[0].session.corpus_id)
    if pinned is not None and pinned.model_fingerprint in TINY_FINGERPRINTS.values():
        lines[-1:] = [
            "  (the built-in tiny model has random weights: its answers are noise; what this",
            "   shows is the path, one prefill forked by every agent with attention routed to",
            "   the holders, and its timings)",
            "",
        ]
    for r in runs:
        lines.append(f"  Q: {r.question}")
        lines.append(f"  A: {r.text.strip()[:110]!r}")
    lines += [
        "",
        f"  {'agent':>5} {'worker':<18} {'prompt':>6} {'tokens':>6} {'open ms':>8} "
        f"{'first ms':>8} {'p50 ms/tok':>10} {'p90 ms/tok':>10}  finish",
    ]
    gaps_all: list[float] = []
    for i, r in enumerate(runs):
        gaps = sorted(r.gaps) or [0.0]
        p50, p90 = statistics.median(gaps), gaps[int(0.9 * (len(gaps) - 1))]
        gaps_all += r.gaps
        lines.append(
            f"  {i:>5} {r.session.address:<18} {r.session.prompt_tokens:>6} {r.tokens:>6} "
            f"{r.opened_s * 1e3:>8.0f} {r.first_s * 1e3:>8.0f} "
            f"{p50 * 1e3:>10.1f} {p90 * 1e3:>10.1f}  "
            f"{r.finish}"
        )
    total = sum(r.tokens for r in runs)
    med = statistics.median(gaps_all) if gaps_all else 0.0
    lines += [
        "",
        f"  {total} tokens in {wall:.1f} s ({total / wall:.1f} tok/s in all); "
        f"inter-token p50 {med * 1e3:.1f} ms with {agents} agents in one batch",
        "",
        "metrics (Prometheus text format):",
        *(f"  agent worker {w.report.worker_id:<14} {w.report.metrics_url}" for w in workers),
    ]
    info = running_up()
    if info is not None and info["coordinator"]["address"] == coordinator:
        tls = bool(info.get("security"))
        lines += [f"  coordinator  {'':<14} {_url(info['coordinator']['metrics'], tls)}"]
        lines += [
            f"  holder       {h['address']:<14} {_url(h['metrics'], tls)}" for h in info["holders"]
        ]
    else:
        lines.append(f"  holders: {len(holders)} registered; their metrics ports are in their logs")
    return "\n".join(lines)


def _url(port: int, tls: bool) -> str:
    return f"{'https' if tls else 'http'}://127.0.0.1:{port}/metrics" if port >= 0 else "-"
