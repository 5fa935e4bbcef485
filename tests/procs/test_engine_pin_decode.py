"""An engine pin (``corpusd pin --engine``, against the stand-in SGLang server of
``tests/support/engine_server.py``) published through a real coordinator to a real bf16 CPU holder
and decoded by a real agent: sub-agents on the engine's corpus answer exactly what they answer on
a normal bf16 pin of the same source, and the holder really served the corpus.

Dense regime (``index_topk`` 2048 > the corpus): every key is attended, so the answers depend on
the latent rows alone, which are the same bits in both pins. In a sparse regime they may part: an
engine pin's index keys are the engine's fp8 keys (its float keys are their dequantised, rotated-
back values), a normal pin's the exact ones, and the top-k sees the difference — as it should.
"""

from __future__ import annotations

import asyncio
import io
import re
import tarfile
from pathlib import Path

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.model.tiny import init_tiny
from corpusd.testing.holders import start_holders
from requester.client import Client
from requester.launch import start_agent
from tests.support.checks import metric
from tests.support.engine_server import CaptureEngine
from tests.support.sglang_host import load_hicache

SUFFIXES = ["\nQ: which line holds fox 7?", "\nQ: what comes after line 3?"]
NEW = 6


def _tar(path: Path) -> Path:
    data = "".join(f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(12))
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("src/notes.txt")
        info.size = len(data.encode())
        tar.addfile(info, io.BytesIO(data.encode()))
    return path


def test_an_engine_pin_is_published_and_decodes_as_a_normal_pin(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Both pins prefill through corpus.pin.prefill, whose thread count follows the load
    # average; equal bits need equal counts, so both take this process's (OMP_NUM_THREADS wins).
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    model = init_tiny(tmp_path / "model", preset="sglang", index_topk=2048)
    store, src = tmp_path / "store", _tar(tmp_path / "notes.tar")
    coord = start_coordinator(tmp_path / "coord", store)
    holders = start_holders(store, tmp_path, model, coord.address, 1, "--dtype", "bfloat16")
    agent = None
    engine = CaptureEngine(load_hicache(monkeypatch), tmp_path / "spool", model)
    try:
        base = ["pin", "--corpus", str(src), "--model", str(model), "--store", str(store)]
        base += ["--coordinator", coord.address]
        assert cli_main([*base, "--engine", engine.url, "--name", "engine"]) == 0
        out = capsys.readouterr().out
        assert re.search(r"published via \S+: \d+ pages × 1 on ", out), out
        assert cli_main([*base, "--dtype", "bfloat16", "--name", "normal"]) == 0
        ps = PageStore(store)
        me, mn = (ps.manifest(ps.resolve(n)) for n in ("engine", "normal"))
        assert me.engine["marker"].startswith("sglang-") and me.corpus_id != mn.corpus_id
        pages = list(range(me.n_pages))
        lat_e, _ = ps.read_checked(me, pages)
        lat_n, _ = ps.read_checked(mn, pages)
        assert all(torch.equal(a, b) for a, b in zip(lat_e, lat_n, strict=True))
        agent = start_agent(store, tmp_path / "agent", model, "--coordinator", coord.address)

        async def answers(corpus: str) -> list[list[int]]:
            async with Client(coordinator=coord.address) as c:

                async def one(suffix: str) -> list[int]:
                    s = await c.open_session(corpus, suffix)
                    got: list[int] = []
                    async for chunk in c.generate(s, max_tokens=NEW):
                        got += chunk.token_ids
                    return got

                # one at a time: a batch's make-up changes float sums, not what is attended
                return [await one(s) for s in SUFFIXES]

        async def placed() -> list[str]:
            async with CoordinatorClient(coord.address) as cc:
                return [c.name for c in await cc.list_corpora() if c.state == "ready"]

        assert sorted(asyncio.run(placed())) == ["engine", "normal"]
        eng, normal = asyncio.run(answers("engine")), asyncio.run(answers("normal"))
        assert all(len(a) == NEW for a in eng), eng
        assert eng == normal
        # the holder served the corpus: every corpus chunk was routed to it or fetched from it
        port, name = agent.metrics_port, "corpusd_requester_decisions_total"
        used = {k: metric(port, name, f'primitive="{k}"') for k in ("route", "fetch", "local")}
        assert used["route"] + used["fetch"] > 0 and not used["local"], used
    finally:
        engine.close()
        if agent is not None:
            agent.stop()
        for h in holders:
            h.stop()
        coord.stop()
