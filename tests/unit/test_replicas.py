"""The load-replica policy on synthetic load reports: a window past the elbow adds one replica
of the hottest pages on the coolest holder with room; hysteresis keeps it until the source is
under half its elbow for a window."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from corpusd.coordinator.db import HolderRow
from corpusd.coordinator.replicas import LoadReport, PendingRelease, Replicator


def holder(hid: str) -> HolderRow:
    return HolderRow(hid, f"127.0.0.1:{hash(hid) % 1000 + 1000}", "cpu", 64, 64, "fp", "float32",
                     0, 0, 0.0, 10.0, leased=True)  # fmt: skip


HOLDERS = [holder("a"), holder("b"), holder("c")]
HELD = {"a": {"x": set(range(10))}}
LOADABLE = {"x": {"a", "b", "c"}}


def feed(r: Replicator, t0: float, t1: float, fanin: dict[str, int], hot: dict[int, int]) -> None:
    """Reports every 0.5 s from t0 to t1: holder a's pages ``hot`` (page → hits)."""
    t = t0
    while t <= t1:
        for hid, f in fanin.items():
            r.observe(
                hid,
                LoadReport(t, f, 8, {("x", p): n for p, n in hot.items()} if hid == "a" else {}),
            )
        t += 0.5


def test_past_the_elbow_for_a_window_adds_one_replica_of_the_hottest_pages_on_the_coolest() -> None:
    r = Replicator(window_s=5, max_pages=3)
    free = {"a": 0, "b": 40, "c": 50}
    feed(r, 0, 4, {"a": 20, "b": 6, "c": 1}, {1: 50, 2: 90, 3: 10, 7: 70})
    assert r.decide(4, HOLDERS, HELD, free, LOADABLE) == []  # not a whole window yet
    feed(r, 4.5, 6, {"a": 20, "b": 6, "c": 1}, {1: 50, 2: 90, 3: 10, 7: 70})
    (d,) = r.decide(6, HOLDERS, HELD, free, LOADABLE)
    assert (d.action, d.replica.target, d.replica.pages) == ("add", "c", (1, 2, 7))
    # c past its own elbow, or without room: b instead; neither: nothing
    feed(r, 6.5, 6.5, {"a": 20, "b": 6, "c": 9}, {2: 1})
    assert r.decide(6.5, HOLDERS, HELD, free, LOADABLE)[0].replica.target == "b"
    assert r.decide(6.5, HOLDERS, HELD, {"b": 2, "c": 50}, LOADABLE) == []


def test_one_report_under_the_elbow_in_the_window_means_not_hot() -> None:
    r = Replicator(window_s=5)
    feed(r, 0, 10, {"a": 20, "b": 0}, {1: 5})
    r.observe("a", LoadReport(8, 3, 8, {}))
    assert r.decide(10, HOLDERS, HELD, {"b": 40, "c": 40}, LOADABLE) == []
    assert r.decide(13.5, HOLDERS, HELD, {"b": 40, "c": 40}, LOADABLE) == []  # no report since


def test_hysteresis_keeps_the_replica_until_the_source_is_cool_for_a_window() -> None:
    r = Replicator(window_s=5)
    feed(r, 0, 6, {"a": 20, "b": 0, "c": 0}, {4: 9})
    (d,) = r.decide(6, HOLDERS, HELD, {"b": 40, "c": 40}, LOADABLE)
    r.added[("x", "a")] = d.replica
    held = {"a": {"x": set(range(10))}, d.replica.target: {"x": {4}}}
    assert r.decide(6, HOLDERS, held, {"b": 40, "c": 40}, LOADABLE) == []  # not twice
    feed(r, 6.5, 20, {"a": 6, "b": 0, "c": 0}, {})  # under the elbow, above half of it
    assert r.decide(20, HOLDERS, held, {"b": 40, "c": 40}, LOADABLE) == []
    feed(r, 20.5, 24, {"a": 3, "b": 0, "c": 0}, {})  # under half, not yet for a window
    assert r.decide(24, HOLDERS, held, {"b": 40, "c": 40}, LOADABLE) == []
    feed(r, 24.5, 26, {"a": 3, "b": 0, "c": 0}, {})
    (gone,) = r.decide(26, HOLDERS, held, {"b": 40, "c": 40}, LOADABLE)
    assert (gone.action, gone.replica) == ("remove", d.replica)
    # a corpus unpinned meanwhile loses its replica at once
    assert r.decide(7, HOLDERS, held, {}, {})[0].action == "remove"


def test_a_replica_that_split_the_load_stays_until_the_total_falls() -> None:
    """Removal judges the source and the target together: a replica that halved the source's
    fan-in (20 → 3 + 3 on the copy) is kept while the total stays above half the elbow
    (bench_fanin: judged on the source alone it went 11–13 s after it came, under load)."""
    r = Replicator(window_s=5)
    feed(r, 0, 6, {"a": 20, "b": 0, "c": 0}, {4: 9})
    (d,) = r.decide(6, HOLDERS, HELD, {"b": 40, "c": 40}, LOADABLE)
    r.added[("x", "a")] = d.replica
    held = {"a": {"x": set(range(10))}, d.replica.target: {"x": {4}}}
    other = "b" if d.replica.target == "c" else "c"
    feed(r, 6.5, 20, {"a": 3, d.replica.target: 3, other: 0}, {})  # each under half: 6 in all
    assert r.decide(20, HOLDERS, held, {"b": 40, "c": 40}, LOADABLE) == []
    feed(r, 20.5, 26, {"a": 2, d.replica.target: 2, other: 0}, {})  # 4 in all: half the elbow
    (gone,) = r.decide(26, HOLDERS, held, {"b": 40, "c": 40}, LOADABLE)
    assert (gone.action, gone.replica) == ("remove", d.replica)


class _Links:
    """Release calls as the holder sees them; the first ``cancel`` calls are cancelled."""

    def __init__(self, cancel: int = 0) -> None:
        self.released: list[tuple[str, str, list[int]]] = []
        self.cancel = cancel

    async def release(self, hid: str, address: str, cid: str, pages: list[int]) -> int:
        if self.cancel:
            self.cancel -= 1
            raise asyncio.CancelledError
        self.released.append((hid, cid, pages))
        return len(pages)


class _State:
    def __init__(self, table: dict[int, list[tuple[str, int]]]) -> None:
        self.table, self.used = table, {"b": 3}

    async def page_table(self, cid: str) -> dict[int, list[tuple[str, int]]]:
        return {p: list(r) for p, r in self.table.items()}

    async def add_used(self, hid: str, n: int) -> None:
        self.used[hid] += n


def test_a_removed_copy_is_released_after_its_grace_sparing_pages_a_newer_replica_reuses() -> None:
    """The copy's frames outlive the page-table write by ``grace_s`` (readers of the older table
    still route to them); pages the table gives the target again by then are not released; a
    round cancelled during the Release keeps it pending and the next round releases it."""
    r = Replicator(window_s=5, grace_s=2)
    r.pending.append(PendingRelease("x", "b", frozenset({1, 2, 3}), due=12))
    table = {p: [("a", p)] for p in range(10)}
    table[2] = [("a", 2), ("b", 7)]  # a newer replica put page 2 on b again
    links, state = _Links(cancel=1), _State(table)
    pub = SimpleNamespace(links=links, capacity_changed=asyncio.Event())
    by_id = {h.holder_id: h for h in HOLDERS}

    async def rounds() -> None:
        await r._release_due(pub, state, by_id, 11.9)  # type: ignore[arg-type]
        assert links.released == [] and len(r.pending) == 1  # within the grace
        with pytest.raises(asyncio.CancelledError):
            await r._release_due(pub, state, by_id, 12)  # type: ignore[arg-type]
        assert len(r.pending) == 1  # cancelled mid-call: still pending
        await r._release_due(pub, state, by_id, 12.5)  # type: ignore[arg-type]

    asyncio.run(rounds())
    assert links.released == [("b", "x", [1, 3])] and r.pending == []
    assert state.used["b"] == 1


def test_a_grace_or_window_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        Replicator(window_s=5, grace_s=-1)
