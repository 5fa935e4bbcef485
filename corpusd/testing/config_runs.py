"""One drawn DeepSeek-V3.2 config end to end: transformers saves it → corpusd loads it (or refuses
it in one line naming the field) → a corpus is pinned and placed on real holder processes → a
requester Worker decodes through them → the tokens are compared with transformers' ``generate``.
Shared by tests/procs/test_model_configs.py and tools/config_sweep.py."""

from __future__ import annotations

import asyncio
import random
import time
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


def _oracle(model_dir: Path, corpus: torch.Tensor, ties: Ties | None = None) -> list[Run]:
    import transformers

    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return greedy(hf, corpus, SUFFIXES, NEW_TOKENS, ties)


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


def run_config(tmp: Path, drawn: Drawn) -> ConfigResult:
    """Run ``drawn`` in ``tmp`` (a fresh directory); never raises for the config's own sake — the
    result says what happened. The indexer mode alternates with the seed (even: replica, odd:
    distributed); the primitive is ``route``, so every attention step asks the holders."""
    t0 = time.monotonic()
    indexer = "replica" if drawn.seed % 2 == 0 else "distributed"
    r = ConfigResult(drawn.seed, drawn.overrides, drawn.refused_field, indexer)
    try:
        _run(tmp, drawn, r)
    except Exception as e:  # recorded: the caller asserts on the status
        r.status, r.detail = "error", f"{type(e).__name__}: {e}"[:2000]
    r.seconds = round(time.monotonic() - t0, 2)
    return r


def _run(tmp: Path, drawn: Drawn, r: ConfigResult) -> None:
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
    write_hf_checkpoint(model_dir, seed=drawn.seed, **drawn.overrides)
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
    try:
        asyncio.run(_deal(cid, holders, store.manifest(cid).n_pages, drawn.seed))
        ties = Ties()
        oracle = _oracle(model_dir, corpus, ties)
        r.extra["ties_at_cut"] = ties.total  # rows whose cut a tie rule decided (both sides')
        cfg = WorkerConfig(indexer=r.indexer, primitive="route", trace=True)
        tokens, logits, w = asyncio.run(
            decode(model, store, cid, [h.address for h in holders], cfg, SUFFIXES, NEW_TOKENS)
        )
    finally:
        for h in holders:
            h.stop()
    assert {t["pick"] for t in w.trace} == {"route"}, {t["pick"] for t in w.trace}
    r.extra["holders_used"] = len({t["holder"] for t in w.trace})
    worst = 0.0
    for a, ((ref_tokens, ref_logits), got, got_logits) in enumerate(
        zip(oracle, tokens, logits, strict=True)
    ):
        if got != ref_tokens:
            r.status, r.detail = "mismatch", f"agent {a}: tokens {got} != generate's {ref_tokens}"
            return
        worst = max([worst] + [rel(g, x) for g, x in zip(got_logits, ref_logits, strict=True)])
    r.worst_logits_rel = worst
    if worst > LOGITS_REL:
        r.status, r.detail = "mismatch", f"logits rel {worst:.2e} > {LOGITS_REL:.0e}"
        return
    r.status = "ok"
