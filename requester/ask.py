"""``corpusd ask``: one question over a pinned corpus, its answer streamed to the terminal token
by token as the agent worker generates it (through ``requester.Client``, so a worker that dies
mid-answer is replaced without a gap). The answer goes to stdout; notes and timings to stderr.
"""

from __future__ import annotations

import re
import time
from typing import TextIO

from corpusd.coordinator.client import CoordinatorClient
from corpusd.model.tiny import TINY_FINGERPRINTS
from requester.client import Client

#: the prompt a question becomes after the corpus (also ``corpusd agents``')
PROMPT = "\n\nQ: {question}\nA:"
# C0 and C1 control characters but newline and tab: a terminal would act on them (escape
# sequences), and the tiny model's random bytes contain them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters (but ``\\n`` and ``\\t``) shown as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


async def ask(
    corpus: str,
    question: str,
    out: TextIO,
    err: TextIO,
    *,
    coordinator: str = "",
    agent: str = "",
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> str:
    """Stream the answer to ``question`` over ``corpus`` (id, name or id prefix) to ``out`` as it
    comes; returns why it stopped ("stop" or "length"). The session is closed whatever happens.
    Raises AgentError (an unknown corpus, a refused request, no worker)."""
    t0 = time.perf_counter()
    async with Client(agent=agent, coordinator=coordinator) as c:
        s = await c.open_session(corpus, PROMPT.format(question=question), max_tokens)
        noise = bool(coordinator) and await _tiny(coordinator, s.corpus_id)
        tokens, first, finish = 0, 0.0, ""
        try:
            async for chunk in c.generate(
                s, max_tokens=max_tokens, temperature=temperature, seed=seed
            ):
                if not tokens:
                    first = time.perf_counter() - t0
                    if noise:  # said once the answer starts: a refusal stays one line
                        err.write(
                            "(the built-in tiny model has random weights: its answer is noise)\n"
                        )
                        err.flush()
                tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
                out.write(printable(chunk.text))
                out.flush()
        finally:
            await c.close_session(s)
    wall = time.perf_counter() - t0
    rate = (tokens - 1) / (wall - first) if tokens > 1 and wall > first else 0.0
    out.write("\n")
    err.write(
        f"[{tokens} tokens, {finish or 'stopped'}; first token {first * 1e3:,.0f} ms, then "
        f"{rate:.1f} tok/s; corpus {s.corpus_id[:12]} ({s.corpus_tokens:,} tokens), worker "
        f"{s.address}]\n"
    )
    return finish


async def _tiny(coordinator: str, corpus_id: str) -> bool:
    """Whether the corpus was pinned with the random-weight tiny model."""
    async with CoordinatorClient(coordinator) as cc:
        return any(
            x.corpus_id == corpus_id and x.model_fingerprint in TINY_FINGERPRINTS.values()
            for x in await cc.list_corpora()
        )
