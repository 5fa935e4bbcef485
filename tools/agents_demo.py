"""8 sub-agents over one pinned corpus: pin the sample repository, start holders on loopback,
spread its pages over them, and decode every agent's question against it at once.

    python -m tools.agents_demo [--holders 2] [--agents 8] [--tokens 24] [--primitive auto]

The tiny default model has random weights, so the answers are noise; what the demo shows is
the machinery: one corpus prefilled once, 8 forks decoding concurrently, attention over the
corpus routed to the holders and merged exactly, and what the predicate decided.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from corpusd.corpus.pin import PinConfig, default_model, pin, sample_repo
from corpusd.corpus.store import PageStore
from corpusd.model import load_model
from corpusd.tokenizer import load_tokenizer
from holder.launch import start_holder
from requester.holder_client import HolderClient
from requester.sampling import SamplingParams
from requester.worker import Worker, WorkerConfig

QUESTIONS = [
    "What does env.py declare?",
    "Where is the page store?",
    "How does the progress bar print?",
    "What is a manifest?",
    "Which file renders the layout?",
    "What is CORPUSD_HOME?",
    "How are corpus ids made?",
    "What is the token stream?",
]


async def decode(model, store, cid, addresses, a, tok) -> Worker:
    w = Worker(model, WorkerConfig(primitive=a.primitive, trace=True), store=store)
    await w.attach(cid, addresses)
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(a.agents)]
    sessions = [
        w.open(cid, tok.encode(f"\nQ: {q}\nA:"), params=SamplingParams(max_tokens=a.tokens))
        for q in qs
    ]
    steps = []
    t0 = time.perf_counter()
    async for _ in w.stream(sessions):
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    for q, s in zip(qs, sessions, strict=True):
        print(f"  {q:<36} → {tok.decode(s.generated)!r}")
    decode_steps = sorted(steps[1:])
    med = decode_steps[len(decode_steps) // 2]
    picks: dict[str, int] = {}
    for t in w.trace:
        picks[t["pick"]] = picks.get(t["pick"], 0) + 1
    print(
        f"\n{a.agents} agents, {len(steps)} steps: prompt step {steps[0] * 1e3:.0f} ms, "
        f"decode step p50 {med * 1e3:.0f} ms ({a.agents / med:.1f} tok/s in all); "
        f"predicate decisions per (layer, holder group): {picks}"
    )
    await w.close()
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--holders", type=int, default=2)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--primitive", default="auto", choices=("auto", "route", "fetch", "local"))
    a = p.parse_args()
    mdir = default_model(sys.stderr)
    r = pin(PinConfig(corpus=str(sample_repo()), model=str(mdir), name="sample-repo"))
    m = r.manifest
    store = PageStore(r.path.parent.parent)
    print(f"corpus {m.name} ({m.corpus_id[:12]}): {m.token_count:,} tokens, {m.n_pages} pages")
    state = Path(tempfile.mkdtemp(prefix="corpusd-agents-"))
    holders = [start_holder(store.root, state / f"h{i}", mdir) for i in range(a.holders)]
    addresses = [h.address for h in holders]
    try:

        async def spread() -> None:
            for i, addr in enumerate(addresses):
                c = HolderClient(addr)
                await c.assign(m.corpus_id, list(range(i, m.n_pages, len(addresses))))
                await c.close()

        asyncio.run(spread())
        print(f"pages spread over {len(addresses)} holders: {', '.join(addresses)}\n")
        model = load_model(mdir, dtype=torch.float32)
        tok = load_tokenizer(mdir, model.cfg.bos_token_id, model.cfg.eos_token_id)
        asyncio.run(decode(model, store, m.corpus_id, addresses, a, tok))
    finally:
        for h in holders:
            h.stop()


if __name__ == "__main__":
    main()
