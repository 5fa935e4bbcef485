"""Replicated pages spread by measured holder speed (requester/balance.py, CorpusView.reweighted):
a slower copy gets fewer pages, the split keeps failover's exclusions, and a binding over a fake
slow holder moves pages off it while the merged result stays exact."""

from __future__ import annotations

import asyncio

import pytest
import torch

from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel
from requester.balance import HolderSpeed
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding
from requester.holder_client import Partial
from tests.unit.test_fanout import GEO, FakeRoute, engine, inputs, placed


def view_of(replicas: list[list[int]], holders: int = 2) -> CorpusView:
    reps = tuple(tuple((h, p) for h in hs) for p, hs in enumerate(replicas))
    zeros = torch.zeros(len(replicas), dtype=torch.int64)
    names = tuple(f"h{i}" for i in range(holders))
    return CorpusView("c", 4 * len(replicas), 4, names, zeros, zeros, reps).failover(())


def shares(view: CorpusView) -> list[int]:
    return torch.bincount(view.page_holder, minlength=len(view.holders)).tolist()


def test_pages_follow_the_weights_and_none_keeps_page_mod_n() -> None:
    v = view_of([[0, 1]] * 12)
    assert v.page_holder.tolist() == [p % 2 for p in range(12)]  # no weights: p mod n
    assert shares(v.reweighted((1.0, 1.0))) == [6, 6]
    assert shares(v.reweighted((2.0, 1.0))) == [8, 4]
    assert shares(v.reweighted((1.0, 3.0))) == [3, 9]
    assert torch.equal(v.reweighted((2.0, 1.0)).reweighted(None).page_holder, v.page_holder)
    # the chosen frame is the chosen copy's own frame
    w = v.reweighted((2.0, 1.0))
    for p in range(12):
        assert (int(w.page_holder[p]), int(w.page_frame[p])) in v.replicas[p]
    with pytest.raises(ValueError, match="3 weights for 2 holders"):
        v.reweighted((1.0, 1.0, 1.0))


def test_single_copies_count_before_shared_pages_are_spread() -> None:
    # 6 pages only on h0 (the hot holder), 6 copied to h1 (a load replica): by page number h0
    # would serve 9 of 12; by (equal) weights the 6 shared pages all go to h1
    v = view_of([[0]] * 6 + [[0, 1]] * 6)
    assert shares(v) == [9, 3]
    assert shares(v.reweighted((1.0, 1.0))) == [6, 6]


def test_weights_keep_failed_holders_out() -> None:
    v = view_of([[0, 1, 2]] * 9, holders=3).failover({1})
    w = v.reweighted((1.0, 5.0, 1.0))  # the dead holder's speed does not bring it back
    assert 1 not in w.page_holder.tolist() and shares(w) == [5, 0, 4] and w.excluded == {1}
    assert v.same_table(w)


def test_holder_speed_measures_normalises_and_waits() -> None:
    now = [0.0]
    s = HolderSpeed(alpha=0.5, min_calls=3, every_s=1.0, change=0.1, clock=lambda: now[0])
    for _ in range(3):
        s.observe("fast", 10, 0.010)  # 1 ms a row
        s.observe("slow", 10, 0.020)
    s.observe("idle", 0, 5.0)  # no rows: nothing learnt
    assert "idle" not in s.per_row
    w = s.weights(("fast", "slow"))
    assert w is not None and w[0] == pytest.approx(4 / 3) and w[1] == pytest.approx(2 / 3)
    # one measured holder is nothing to compare; an unmeasured one gets the median
    assert s.weights(("fast", "new")) is None
    assert s.weights(("fast", "slow", "new")) == pytest.approx((4 / 3, 2 / 3, 1.0))
    assert s.due(("fast", "slow"), None) == w
    assert s.due(("fast", "slow"), None) is None  # not a second since the last
    now[0] = 1.5
    assert s.due(("fast", "slow"), w) is None  # nothing moved
    s.observe("slow", 10, 0.010)  # the slow holder speeds up: its ewma halves the gap
    now[0] = 3.0
    got = s.due(("fast", "slow"), w)
    full = s.weights(("fast", "slow"))
    assert got is not None and full is not None and w[1] < got[1] < full[1]  # half way there
    assert got == pytest.approx(tuple((a + b) / 2 for a, b in zip(w, full, strict=True)))
    with pytest.raises(ValueError, match="alpha"):
        HolderSpeed(alpha=0.0)


class SlowRoute(FakeRoute):
    """A fake holder that takes ``per_row_s`` a query row, as a slower copy does."""

    def __init__(self, pool: torch.Tensor, d_v: int, per_row_s: float) -> None:
        super().__init__(pool, d_v)
        self.per_row_s = per_row_s
        self.rows_served = 0

    async def attend_rows(self, corpus_id: str, layer: int, q: torch.Tensor, rows: torch.Tensor,
                          scale: float, timeout: float | None = None) -> Partial:  # fmt: skip
        self.rows_served += int((rows >= 0).sum())
        await asyncio.sleep(self.per_row_s * int((rows >= 0).sum()))
        return await super().attend_rows(corpus_id, layer, q, rows, scale, timeout)


def test_a_binding_moves_pages_off_a_slow_copy_and_stays_exact() -> None:
    rows, q, canon = inputs(7, n=6, k=20)
    view, fake = placed(rows, ("fast", "slow"), [[0, 1]] * 6)
    routes = {
        "fast": SlowRoute(fake["fast"].pool, GEO.d_v, 0.0002),
        "slow": SlowRoute(fake["slow"].pool, GEO.d_v, 0.0008),
    }
    f = engine(routes)  # type: ignore[arg-type]
    b = CorpusBinding(f, view, GEO)
    b.speed = HolderSpeed(alpha=0.5, min_calls=4, every_s=0.0)
    want = partial_attention(q, rows, canon, GEO.softmax_scale, GEO.d_v)

    async def go() -> None:
        for _ in range(12):
            o, lse = await b.attend(0, q, canon)
            assert rel(o, want[0]) < 1e-5 and torch.allclose(lse, want[1], atol=1e-5)

    asyncio.run(go())
    assert b.view.weights is not None and b.view.weights[0] > 2 * b.view.weights[1]
    assert shares(b.view)[0] >= 4, shares(b.view)  # most of the 6 pages on the fast copy
    assert f.metrics.rebalances._value.get() >= 1  # type: ignore[attr-defined]
    before = routes["slow"].rows_served
    asyncio.run(b.attend(0, q, canon))
    slow_share = (routes["slow"].rows_served - before) / int((canon >= 0).sum())
    assert slow_share < 0.4, slow_share  # by page number it was about half
