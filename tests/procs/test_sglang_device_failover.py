"""Failover on the SGLang plugin's device path (requester/sglang/device_failover.py), on CPU:
holders found dead by health checks (two misses in a row, a single miss forgiven), their pages
re-planned between steps onto live replicas or kept on the dead holder's still-mapped pool, the
tables rewritten, the failover counted; against real holder processes, one SIGKILLed, found
dead within a second while the other is never suspected. The same path inside a live SGLang
server under decode is tests/sglang/test_sglang_device_failover.py (GPU)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from corpusd.kernels.reference import partial_attention
from corpusd.testing.holders import start_holder, synthetic_corpus
from corpusd.testing.numeric import rel
from holder.launch import HolderProcess
from requester.corpus_view import CorpusView
from requester.holder_client import HolderClient
from requester.sglang import device, device_failover
from requester.sglang.binding import CorpusBindingError
from requester.sglang.device_failover import MISSES, HolderWatch
from requester.sglang.metrics import PluginMetrics
from requester.sglang.resident import FailedOver, Resident

D = 576
FRAMES = (3, 7, 1, 5)


def _resident(addresses: tuple[str, str]) -> tuple[Resident, torch.Tensor, CorpusView]:
    """A CPU arena over two holders' pools, each with a copy of one 4-page corpus (the second
    10 frames further on); page ``p``'s first replica is on holder ``p % 2``."""
    g = torch.Generator().manual_seed(5)
    res = Resident(n_layers=2, page_size=64, index_dim=128, arena_tokens=1024,
                   window_tokens=512, device="cpu", ue8m0=False, req_slots=4)  # fmt: skip
    canon = torch.randn(len(FRAMES) * 64, D, generator=g)
    for i, a in enumerate(addresses):
        pool = torch.zeros(40 * 64, D)
        for p, f in enumerate(FRAMES):
            pool[(f + 10 * i) * 64 : (f + 10 * i + 1) * 64] = canon[p * 64 : (p + 1) * 64]
        res.add_pool(a, [pool, pool.clone()])
    replicas = tuple(((p % 2, f + 10 * (p % 2)), (1 - p % 2, f + 10 * (1 - p % 2)))
                     for p, f in enumerate(FRAMES))  # fmt: skip
    first = [r[0] for r in replicas]
    view = CorpusView("c", len(FRAMES) * 64, 64, addresses,
                      torch.tensor([h for h, _ in first]), torch.tensor([f for _, f in first]),
                      replicas, pinned=2)  # fmt: skip
    res.load(view, [torch.randn(view.token_count, 128, generator=g) for _ in range(2)])
    return res, canon, view


def _partial(res: Resident, canon: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    n, k = 3, 40
    q = torch.randn(n, 8, D, generator=g)
    pos = torch.stack([torch.randperm(canon.shape[0], generator=g)[:k] for _ in range(n)])
    base = torch.full((n,), res.corpora["c"].base_page, dtype=torch.int32)
    got = device.corpus_partial(res, 1, q, pos, base, D**-0.5, 512, base2=False)
    want = partial_attention(q, canon, pos, D**-0.5, 512)
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-6
    return got


def _metric(m: PluginMetrics, name: str) -> dict[str, float]:
    text = generate_latest(m.registry).decode().splitlines()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text
        if line.startswith(name) and not line.startswith("#")
    }


class Flaky:
    """alive() answers from a script: per address, a list of answers, the last repeated."""

    def __init__(self, script: dict[str, list[bool]]) -> None:
        self.script, self.asked = script, {a: 0 for a in script}

    async def __call__(self, address: str, timeout: float) -> bool:
        i = self.asked[address]
        self.asked[address] += 1
        answers = self.script[address]
        return answers[min(i, len(answers) - 1)]


def test_a_holder_missing_two_checks_in_a_row_fails_over_at_the_next_step_and_is_counted() -> None:
    res, canon, _ = _resident(("h0", "h1"))
    metrics = PluginMetrics()
    # h0 misses one check, answers, misses one again: busy, never failed; h1 misses two
    alive = Flaky({"h0": [False, True, False, True], "h1": [True, False, False]})
    watch = HolderWatch(res, alive, metrics, every_s=0.25)
    assert MISSES == 2
    found = [asyncio.run(watch.probe()) for _ in range(4)]
    assert found == [set(), set(), {"h1"}, set()]
    assert alive.asked == {"h0": 4, "h1": 3}  # a holder found dead is asked no more
    span = slice(0, 4)
    assert res.page_holder[span].tolist() == [0, 1, 0, 1]  # nothing moves before the step
    assert watch.pending
    assert watch.at_step_boundary() == [FailedOver("c", replica=2, kept=0)]
    assert not watch.pending and watch.at_step_boundary() == []
    assert res.page_holder[span].tolist() == [0] * 4 and res.dead == {"h1"}
    assert res.page_frame[span].tolist() == [3, 7, 1, 5]  # h0's own copies
    _partial(res, canon)
    assert _metric(metrics, "corpusd_requester_sglang_failed_holders_total") == {
        'corpusd_requester_sglang_failed_holders_total{holder="h1"}': 1.0
    }
    pages = _metric(metrics, "corpusd_requester_sglang_failover_pages_total")
    assert pages['corpusd_requester_sglang_failover_pages_total{to="replica"}'] == 2.0
    fallbacks = _metric(metrics, "corpusd_requester_fallbacks_total")
    assert fallbacks == {'corpusd_requester_fallbacks_total{from="route",to="replica"}': 1.0}


def test_pages_with_no_live_replica_stay_on_the_dead_holders_kept_pool() -> None:
    """Both holders die: every page is read from its first replica's pool, which the CUDA IPC
    mapping keeps (here: the pools stay as they were), and the partial is unchanged. A corpus
    loaded after the deaths is refused with the reason, not read from a pool a restarted
    holder no longer has."""
    res, canon, view = _resident(("h0", "h1"))
    before = _partial(res, canon)
    assert res.fail_over({"h1"}) == [FailedOver("c", replica=2, kept=0)]
    assert res.fail_over({"h0"}) == [FailedOver("c", replica=0, kept=4)]
    assert res.page_holder[0:4].tolist() == [0, 1, 0, 1]  # back on the first replicas' pools
    after = _partial(res, canon)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    res.forget("c")
    with pytest.raises(CorpusBindingError, match=r"pages \[0, 1, 2, 3\].*restarted SGLang"):
        res.load(view, [torch.zeros(view.token_count, 128)] * 2)


def test_the_step_hook_never_raises_and_waits_for_nothing_when_nothing_failed() -> None:
    res, _, _ = _resident(("h0", "h1"))
    watch = HolderWatch(res, Flaky({"h0": [True], "h1": [False]}), PluginMetrics(), 0.25)
    device_failover._WATCH = watch
    try:
        device_failover.at_step_boundary()  # nothing pending: nothing done
        assert res.dead == set()
        for _ in range(MISSES):
            asyncio.run(watch.probe())

        def broken(failed: set[str]) -> list[FailedOver]:
            raise RuntimeError("a table write failed")

        res.fail_over = broken  # type: ignore[method-assign]
        device_failover.at_step_boundary()  # logged, not raised: the step reads the old tables
        assert not watch.pending
    finally:
        device_failover.stop()
    assert device_failover._WATCH is None


@pytest.fixture
def holders(tmp_path: Path, sglang_dir: Path) -> Iterator[list[HolderProcess]]:
    store = tmp_path / "store"
    synthetic_corpus(store, sglang_dir, 64, seed=1)
    hs = [start_holder(store, tmp_path / f"h{i}", sglang_dir) for i in range(2)]
    yield hs
    for h in hs:
        if h.proc.poll() is None:
            h.stop()


def test_a_sigkilled_holder_is_found_dead_within_a_second_and_the_live_one_never(
    holders: list[HolderProcess],
) -> None:
    """Real holder processes and real health checks, on a loop in its own thread as the
    plugin's catalog runs them: holder 1 is SIGKILLed, found dead and failed over at the next
    step within a second (two 0.25 s probes; the test allows 1.5 s on a loaded machine);
    holder 0 answers every check throughout."""
    addresses = (holders[0].address, holders[1].address)
    res, canon, _ = _resident(addresses)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    clients: dict[str, HolderClient] = {}

    async def alive(address: str, timeout: float) -> bool:
        if address not in clients:
            clients[address] = HolderClient(address)
        return await clients[address].alive(timeout)

    metrics = PluginMetrics()
    watch = HolderWatch(res, alive, metrics, every_s=0.25)
    device_failover.start(watch, loop)
    try:
        time.sleep(1.0)  # four rounds with both alive: nobody suspected
        assert not watch.pending and res.dead == set()
        holders[1].proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        moved: list[FailedOver] = []
        while not moved and time.monotonic() - killed < 5:
            time.sleep(0.01)  # a 10 ms decode step
            device_failover.at_step_boundary()
            moved = watch.failed_over
        took = time.monotonic() - killed
        assert moved == [FailedOver("c", replica=2, kept=0)], f"nothing failed over in {took:.2f} s"
        print(f"found dead and failed over {took:.3f} s after the kill")
        assert took <= 1.5, f"found dead and failed over {took:.2f} s after the kill"
        assert res.dead == {addresses[1]} and res.page_holder[0:4].tolist() == [0] * 4
        _partial(res, canon)
        time.sleep(0.75)  # holder 0 is still checked, and still answers
        assert res.dead == {addresses[1]}
    finally:
        device_failover.stop()
        for c in clients.values():
            asyncio.run_coroutine_threadsafe(c.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
