"""One drawn DeepSeek-V3.2 config end to end: transformers saves it → corpusd loads it (or refuses
it in one line naming the field) → a corpus is pinned and placed on real holder processes → a
requester Worker decodes through them → the tokens are compared with transformers' ``generate``.
Shared by tests/procs/test_model_configs.py and tools/config_sweep.py."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig, ModelConfigError, load_model
from corpusd.testing.hf_checkpoints import Drawn, write_hf_checkpoint, write_hf_config
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.numeric import rel
from corpusd.testing.oracle import Run, Ties, decode, greedy
from holder.launch import HolderProcess
from requester.config import WorkerConfig
from requester.holder_client import HolderClient

CORPUS_TOKENS, NEW_TOKENS, HOLDERS = 256, 6, 2
KILL_AT = 2  # the decode step at whose start holder 0 is SIGKILLed (failover runs)
SUFFIXES = ["\nQ: line 3?", "\nQ: fox 97?"]
LOGITS_REL = 1e-4


@dataclass
class ConfigResult:
    """What became of one drawn config. ``status``: ``ok`` (tokens equal ``generate``'s, logits
    within ``LOGITS_REL``), ``refused`` (ModelConfigError at load; ``detail`` is its message),
    ``mismatch`` (``detail`` says which agent, tokens and logits) or ``error`` (anything else
    raised; ``detail`` is the exception)."""

    seed: int
    overrides: dict[str, Any]
    refused_field: str | None
    indexer: str = ""
    status: str = ""
    detail: str = ""
    seconds: float = 0.0
    worst_logits_rel: float | None = None
    sparse: bool | None = None  # index_topk < the decoded sequence's length
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _oracle(
    model_dir: Path, corpus: torch.Tensor, ties: Ties | None = None,
    guess: list[list[int]] | None = None,
) -> list[Run]:  # fmt: skip
    """transformers' greedy (``guess``: the decode's tokens, checked by one forward: ``greedy``)."""
    import transformers

    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return greedy(hf, corpus, SUFFIXES, NEW_TOKENS, ties, guess)


async def _deal(cid: str, holders: list[HolderProcess], n_pages: int, seed: int) -> None:
    """Shuffle the pages and deal them round the holders: each holder gets some (a random
    placement of a few pages can leave one holder empty)."""
    pages = list(range(n_pages))
    random.Random(seed).shuffle(pages)
    clients = [HolderClient(h.address) for h in holders]
    try:
        for i, c in enumerate(clients):
            await c.assign(cid, sorted(pages[i :: len(clients)]))
    finally:
        for c in clients:
            await c.close()


def run_config(tmp: Path, drawn: Drawn, failover: bool = False) -> ConfigResult:
    """Run ``drawn`` in ``tmp`` (a fresh directory); never raises for the config's own sake — the
    result says what happened. The indexer mode alternates with the seed (even: replica, odd:
    distributed); the primitive is ``route``, so every attention step asks the holders.
    ``failover``: a served config is decoded a second time with holder 0 SIGKILLed at step
    KILL_AT, and must give the same tokens (``extra["failover"]``: the step it died at, None when
    every session had ended before it, and the groups that fell back)."""
    t0 = time.monotonic()
    indexer = "replica" if drawn.seed % 2 == 0 else "distributed"
    r = ConfigResult(drawn.seed, drawn.overrides, drawn.refused_field, indexer)
    try:
        _run(tmp, drawn, r, failover)
    except Exception as e:  # recorded: the caller asserts on the status
        r.status, r.detail = "error", f"{type(e).__name__}: {e}"[:2000]
    r.seconds = round(time.monotonic() - t0, 2)
    return r


def _run(tmp: Path, drawn: Drawn, r: ConfigResult, failover: bool) -> None:
    model_dir = tmp / "model"
    if drawn.refused_field is not None:
        write_hf_config(model_dir, **drawn.overrides)
        try:
            ModelConfig.from_dir(model_dir)
        except ModelConfigError as e:
            r.status, r.detail = "refused", str(e)
            return
        r.status, r.detail = (
            "error",
            f"not refused (expected a refusal naming {drawn.refused_field})",
        )
        return
    write_hf_checkpoint(model_dir, seed=drawn.seed, minimal=drawn.minimal, **drawn.overrides)
    try:
        model = load_model(model_dir, dtype=torch.float32)
    except ModelConfigError as e:
        r.status, r.detail = "refused", str(e)
        return
    cid = pin_sample(tmp, model_dir, tokens=CORPUS_TOKENS)
    store = PageStore(tmp / "store")
    corpus = store.read_tokens(cid).to(torch.int64)
    r.sparse = model.cfg.index_topk < len(corpus) + min(len(s) for s in SUFFIXES)
    holders: list[HolderProcess] = []
    with ThreadPoolExecutor(HOLDERS) as pool:
        futures = [
            pool.submit(
                start_holder,
                tmp / "store",
                tmp / f"holder{i}",
                model_dir,
                "--capacity-tokens",
                "1024",
            )
            for i in range(HOLDERS)
        ]
        for f in futures:
            try:
                holders.append(f.result())
            except Exception:
                for h in holders:
                    h.stop()
                raise
    addresses = [h.address for h in holders]
    try:
        asyncio.run(_deal(cid, holders, store.manifest(cid).n_pages, drawn.seed))
        cfg = WorkerConfig(indexer=r.indexer, primitive="route", trace=True)
        tokens, logits, w = asyncio.run(
            decode(model, store, cid, addresses, cfg, SUFFIXES, NEW_TOKENS)
        )
        ties = Ties()
        oracle = _oracle(model_dir, corpus, ties, tokens)
        r.extra["ties_at_cut"] = ties.total  # rows whose cut a tie rule decided (both sides')
        assert {t["pick"] for t in w.trace} == {"route"}, {t["pick"] for t in w.trace}
        r.extra["holders_used"] = len({t["holder"] for t in w.trace})
        if not _agrees(r, oracle, tokens, logits, "") or not failover:
            return
        # the same decode with holder 0 SIGKILLed once step KILL_AT has begun: its groups fail
        # over (to the page store: the worker has it), and not one token may change
        killed: list[int] = []
        tokens, logits, w = asyncio.run(
            decode(
                model, store, cid, addresses, cfg, SUFFIXES, NEW_TOKENS,
                _killer(holders[0], killed),
            )
        )  # fmt: skip
        fell = sum(
            w.metrics.fallbacks.labels("route", to)._value.get() for to in ("store", "local")
        )
        r.extra["failover"] = {"killed_at_step": killed[0] if killed else None, "fallbacks": fell}
        if not killed:  # every session ended (EOS) before that step: nothing to fail over
            return
        if _agrees(r, oracle, tokens, logits, "after holder 0 was killed: ") and fell == 0:
            r.status, r.detail = "mismatch", "holder 0 was killed, yet no group fell back"
    finally:
        for h in holders:
            h.stop()


def _killer(h: HolderProcess, killed: list[int]) -> Callable[[Any], Awaitable[None]]:
    """A coroutine (given the worker) that SIGKILLs ``h`` once the worker has stepped KILL_AT
    times, and appends the step count it saw to ``killed``."""

    async def kill(w: Any) -> None:
        while w.steps < KILL_AT:
            await asyncio.sleep(0.002)
        h.kill()
        killed.append(w.steps)

    return kill


def _agrees(
    r: ConfigResult,
    oracle: list[Run],
    tokens: list[list[int]],
    logits: list[list[torch.Tensor]],
    when: str,
) -> bool:
    """Whether every agent's tokens equal ``generate``'s and its logits are within LOGITS_REL;
    sets ``r``'s status (``ok`` or ``mismatch``, ``when`` leading the detail) and its worst rel."""
    worst = 0.0
    for a, ((ref_tokens, ref_logits), got, got_logits) in enumerate(
        zip(oracle, tokens, logits, strict=True)
    ):
        if got != ref_tokens:
            r.status = "mismatch"
            r.detail = f"{when}agent {a}: tokens {got} != generate's {ref_tokens}"
            return False
        worst = max([worst] + [rel(g, x) for g, x in zip(got_logits, ref_logits, strict=True)])
    r.worst_logits_rel = max(worst, r.worst_logits_rel or 0.0)
    if worst > LOGITS_REL:
        r.status, r.detail = "mismatch", f"{when}logits rel {worst:.2e} > {LOGITS_REL:.0e}"
        return False
    r.status = "ok"
    return True
