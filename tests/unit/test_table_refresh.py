"""Re-reading a bound corpus's page table (requester/table_refresh.py): a change of replicas is
staged and adopted only between steps, an unchanged table (failover's choice aside) is not, and
holders a binding marked failed stay failed in the new view until REVIVE_S has passed with
their lease live."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest
import torch

from corpusd.coordinator.client import CoordinatorError
from requester.corpus_view import CorpusView
from requester.metrics import RequesterMetrics
from requester.table_refresh import TableRefresh
from requester.worker import Worker

P = 64


CORPUS = SimpleNamespace(corpus_id="c0", state="ready", tokens=4 * P, page_size=P, replicas=1)


@dataclass
class Table:
    """What ``CorpusView.from_page_table`` reads of a coordinator's PageTable."""

    pages: tuple[tuple[tuple[str, int], ...], ...]
    corpus = CORPUS

    @property
    def holders(self) -> dict[str, SimpleNamespace]:
        return {h: SimpleNamespace(live=True) for r in self.pages for h, _ in r}

    def address(self, h: str) -> str:
        return f"addr-{h}"


ONE = Table(tuple(((("a", p),)) for p in range(4)))
TWO = Table(tuple((("a", p), ("b", 10 + p)) for p in range(4)))  # a load replica on b


def test_same_table_ignores_the_chosen_replica_and_sees_a_new_one() -> None:
    two = CorpusView.from_page_table(TWO)  # type: ignore[arg-type]
    assert two.same_table(two.failover({0}))  # failover only picks another replica
    assert not two.same_table(CorpusView.from_page_table(ONE))  # type: ignore[arg-type]


def test_a_failed_holder_stays_failed_in_the_new_view() -> None:
    two = CorpusView.from_page_table(TWO)  # type: ignore[arg-type]
    view, dead = two.without({"addr-a"})
    assert dead == {0} and view.page_holder.tolist() == [1, 1, 1, 1]
    assert view.page_frame.tolist() == [10, 11, 12, 13]
    one = CorpusView.from_page_table(ONE)  # type: ignore[arg-type]
    kept, dead = one.without({"addr-a"})  # no other replica: kept, rows recomputed by the binding
    assert dead == {0} and kept is one


class Coordinator:
    def __init__(self) -> None:
        self.table, self.calls = ONE, 0

    async def page_table(self, cid: str) -> Table:
        self.calls += 1
        if self.table is None:
            raise CoordinatorError(grpc.StatusCode.UNAVAILABLE, "coordinator down")
        return self.table


def test_a_changed_table_is_staged_and_adopted_between_steps_only() -> None:
    one = CorpusView.from_page_table(ONE)  # type: ignore[arg-type]
    b = SimpleNamespace(view=one, dead=set(), force=None, from_snapshot=None)
    routes: list[str] = []

    async def route(address: str) -> None:
        routes.append(address)

    w = Worker.__new__(Worker)  # the bookkeeping only: no model needed to stage and adopt
    w.corpora, w.staged, w._stepping = {"c0": b}, {}, 0  # type: ignore[dict-item]
    w.metrics, w.fanout = RequesterMetrics(), SimpleNamespace(route=route)  # type: ignore[assignment]
    co = Coordinator()
    r = TableRefresh(w, co)  # type: ignore[arg-type]

    assert asyncio.run(r.once()) == 0 and w.staged == {}  # unchanged: nothing staged
    co.table = TWO
    assert asyncio.run(r.once()) == 1 and b.view is one  # staged, not yet adopted
    assert asyncio.run(r.once()) == 0  # the staged view is what it compares with
    assert routes == ["addr-a", "addr-b"]  # transports set up outside any step
    w._stepping = 1
    with pytest.raises(AssertionError, match="between steps"):
        w.adopt_views()
    w._stepping = 0
    assert w.adopt_views() == 1 and w.staged == {}
    assert b.view.n_pages == 4 and set(b.view.page_holder.tolist()) == {0, 1}
    co.table = None  # coordinator down: the view stays, the failure is counted
    assert (
        asyncio.run(r.once()) == 0
        and b.view.replicas
        == CorpusView.from_page_table(
            TWO  # type: ignore[arg-type]
        ).replicas
    )
    assert w.metrics.rereads.labels("failed")._value.get() == 1
    assert w.metrics.rereads.labels("changed")._value.get() == 1
    assert torch.equal(b.view.page_frame, torch.tensor([0, 11, 2, 13]))


def test_a_failed_holder_with_a_live_lease_is_used_again_after_revive_s() -> None:
    """A holder once failed (a deadline missed under load, or a restart) was avoided for the
    binding's whole life, the table unchanged: its pages served by the other replica or read
    from the page store for good. After REVIVE_S, if the table shows its lease live, the re-read
    stages the view that uses it again; a holder whose lease lapsed stays failed."""
    import time

    from requester import table_refresh

    two = CorpusView.from_page_table(TWO)  # type: ignore[arg-type]
    view, dead = two.without({"addr-a"})
    t_fail = time.monotonic()
    b = SimpleNamespace(view=view, dead=dead, force=None, from_snapshot=None,
                        failed_at={"addr-a": t_fail})  # fmt: skip

    async def route(address: str) -> None:
        pass

    w = Worker.__new__(Worker)
    w.corpora, w.staged, w._stepping = {"c0": b}, {}, 0  # type: ignore[dict-item]
    w.metrics, w.fanout = RequesterMetrics(), SimpleNamespace(route=route)  # type: ignore[assignment]
    co = Coordinator()
    co.table = TWO
    r = TableRefresh(w, co)  # type: ignore[arg-type]
    assert asyncio.run(r.once()) == 0  # failed just now: still avoided
    assert table_refresh.still_failed(b, two, t_fail + table_refresh.REVIVE_S - 1) == {"addr-a"}

    b.failed_at["addr-a"] = t_fail - table_refresh.REVIVE_S  # as if it failed REVIVE_S ago
    lapsed_view = CorpusView.from_page_table(  # type: ignore[arg-type]
        SimpleNamespace(pages=TWO.pages, corpus=CORPUS, address=TWO.address,
                        holders={"a": SimpleNamespace(live=False), "b": SimpleNamespace(live=True)})
    )  # fmt: skip
    assert table_refresh.still_failed(b, lapsed_view) == {"addr-a"}  # its lease lapsed: kept
    assert asyncio.run(r.once()) == 1  # live lease, REVIVE_S on: staged, the table unchanged
    assert w.metrics.rereads.labels("revived")._value.get() == 1
    assert w.adopt_views() == 1
    assert b.dead == set() and b.failed_at == {}
    assert set(b.view.page_holder.tolist()) == {0, 1}  # a's pages are served by a again
    assert asyncio.run(r.once()) == 0  # and then unchanged
