"""Failover at any moment (issue 20, item 2): a holder SIGKILLed during the prompt's prefill step,
between decode steps, while a route call to it is in flight, or while a fetch from it is in
flight. Every page also lives on a second holder, so the failed call's rows are served by the
replica within the same step, nothing is recomputed locally, and every session's tokens are
transformers' ``generate``."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from corpusd.corpus.store import PageStore
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.oracle import Oracle
from holder.launch import HolderProcess
from requester.config import WorkerConfig
from requester.holder_client import HolderClient, Partial
from requester.sampling import SamplingParams
from requester.worker import Worker

T = TypeVar("T")
SUFFIXES = ["\nQ0: line 0?", "\nQ1: line 37?"]
NEW, CORPUS_TOKENS = 8, 700
POOL = ("--capacity-tokens", "2048")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("failover")
    return tmp, pin_sample(tmp, tiny_dir, tokens=CORPUS_TOKENS)


@pytest.fixture(scope="module")
def survivor(corpus: tuple[Path, str], tiny_dir: Path) -> Iterator[HolderProcess]:
    tmp, _ = corpus
    h = start_holder(tmp / "store", tmp / "survivor", tiny_dir, *POOL)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def oracle(corpus: tuple[Path, str], hf_model) -> Oracle:  # type: ignore[no-untyped-def]
    """transformers' greedy answers, computed at the first check from its tokens."""
    tmp, cid = corpus
    toks = PageStore(tmp / "store").read_tokens(cid)
    return Oracle(hf_model, toks, SUFFIXES, NEW)


async def killed_in_flight(doomed: HolderProcess, call: Coroutine[Any, Any, T]) -> T:
    """``call`` sent to a holder frozen by SIGSTOP (it cannot answer), then the holder SIGKILLed
    while the request waits on it: a failure mid-call, every time."""
    doomed.proc.send_signal(signal.SIGSTOP)
    pending = asyncio.ensure_future(call)
    await asyncio.sleep(0.05)
    assert not pending.done(), "a frozen holder answered"
    doomed.kill()
    return await pending


class KillingRoute:
    """The doomed holder's gRPC route: at the first call of step ``at`` it SIGKILLs the holder,
    before sending (``in_flight`` False) or while the call waits on it (True)."""

    name = "grpc"

    def __init__(
        self, client: HolderClient, doomed: HolderProcess, w: Worker, at: int, in_flight: bool
    ) -> None:
        self.client, self.doomed, self.w, self.at, self.in_flight = client, doomed, w, at, in_flight
        self.killed_during: str = ""

    async def attend_rows(self, *args: Any, **kwargs: Any) -> Partial:
        if self.killed_during or self.w.steps < self.at:
            return await self.client.attend_rows(*args, **kwargs)
        if not self.in_flight:
            self.killed_during = "before the call"
            self.doomed.kill()
            return await self.client.attend_rows(*args, **kwargs)
        self.killed_during = "the call"
        return await killed_in_flight(self.doomed, self.client.attend_rows(*args, **kwargs))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "moment",
    ["prefill", "decode", "route-in-flight", "fetch-in-flight"],
)
def test_a_holder_killed_at_any_moment_costs_no_token(  # type: ignore[no-untyped-def]
    tiny_model, tiny_dir, corpus, survivor, oracle, tmp_path: Path, moment: str
) -> None:
    tmp, cid = corpus
    store = PageStore(tmp / "store")
    doomed = start_holder(tmp / "store", tmp_path / "doomed", tiny_dir, *POOL)
    primitive = "fetch" if moment == "fetch-in-flight" else "route"
    at = {"prefill": 0, "decode": 3, "route-in-flight": 2, "fetch-in-flight": 0}[moment]

    async def run() -> tuple[list[list[int]], Worker, str]:
        for h in (survivor, doomed):  # every page on both holders
            await assign_all(h.address, cid, store.manifest(cid).n_pages)
        w = Worker(tiny_model, WorkerConfig(primitive=primitive), store=store)
        said = ""
        try:
            await w.attach(cid, [survivor.address, doomed.address])
            client = w.fanout.client(doomed.address)
            if primitive == "route":
                route = KillingRoute(client, doomed, w, at, moment == "route-in-flight")
                w.fanout.routes[doomed.address] = route  # type: ignore[assignment]
            else:
                real = client.fetch

                async def fetch(*a: Any, **kw: Any) -> Any:
                    return await killed_in_flight(doomed, real(*a, **kw))

                client.fetch = fetch  # type: ignore[method-assign]
            sessions = [
                w.open(cid, list(s.encode()), params=SamplingParams(max_tokens=NEW))
                for s in SUFFIXES
            ]
            await w.generate(sessions)
            if primitive == "route":
                said = route.killed_during
            return [s.generated for s in sessions], w, said
        finally:
            await w.close()

    try:
        tokens, w, said = asyncio.run(run())
    finally:
        doomed.stop()
    assert doomed.proc.returncode is not None
    if moment == "route-in-flight":
        assert said == "the call", said
    want = oracle.tokens(tokens)
    assert tokens == want, f"{moment} ({said}): {tokens} != {want}"
    fell = w.metrics.fallbacks
    assert fell.labels(primitive, "replica")._value.get() >= 1, moment
    assert fell.labels(primitive, "local")._value.get() == 0, moment


async def assign_all(address: str, cid: str, n_pages: int) -> None:
    c = HolderClient(address)
    try:
        await c.assign(cid, list(range(n_pages)))
    finally:
        await c.close()
