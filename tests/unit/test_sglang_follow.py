"""The SGLang link follows its bound corpora's page tables (requester/sglang/follow.py): the
interval variable, the lease it defaults to, and the adoption rule — a re-read view replaces a
binding's only at the first layer of a forward, never mid-forward (CPU; no sglang, no
processes: the link's bookkeeping only)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from corpusd.coordinator.client import CoordinatorError
from corpusd.model import ModelConfig
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding
from requester.sglang.follow import ENV, FALLBACK_S, lease_third, table_refresh_s
from requester.sglang.link import CorpusLink
from tests.unit.test_table_refresh import ONE, TWO


def test_the_interval_variable_is_seconds_0_for_the_lease_or_minus_1() -> None:
    assert table_refresh_s({}) == 0.0 and table_refresh_s({ENV: " "}) == 0.0
    assert table_refresh_s({ENV: "2.5"}) == 2.5 and table_refresh_s({ENV: "0"}) == 0.0
    assert table_refresh_s({ENV: "-1"}) == -1
    for bad in ("x", "-2", "-0.5", "nan", "inf", "1s"):
        with pytest.raises(ValueError, match=f"{ENV}={bad!r}: seconds between re-reads"):
            table_refresh_s({ENV: bad})


def test_the_default_is_the_coordinators_lease_over_3_else_a_constant() -> None:
    async def third(lease: float | Exception) -> float:
        async def lease_s() -> float:
            if isinstance(lease, Exception):
                raise lease
            return lease

        return await lease_third(SimpleNamespace(lease_s=lease_s))  # type: ignore[arg-type]

    assert asyncio.run(third(30.0)) == 10.0
    assert asyncio.run(third(0.0)) == FALLBACK_S  # a coordinator too old to say
    down = CoordinatorError(grpc.StatusCode.UNAVAILABLE, "down")
    assert asyncio.run(third(down)) == FALLBACK_S


def test_a_staged_view_is_adopted_at_a_forwards_first_layer_only(tiny_dir: Path) -> None:
    """Forward 1 runs layers 0-3; the re-read stages a new view while layer 1 runs (it runs on
    the link's loop, between the forward's layer calls): layers 2 and 3 keep the view layer 0
    planned on, forward 2's layer 0 takes the new one. A view staged for a binding that was
    replaced meanwhile is dropped."""
    link = CorpusLink("127.0.0.1:1", ModelConfig.from_dir(tiny_dir), "fp", 64, table_refresh_s=-1)
    cat = link.catalog  # the bindings, their views and the loop
    one = CorpusView.from_page_table(ONE)  # type: ignore[arg-type]
    two = CorpusView.from_page_table(TWO)  # type: ignore[arg-type]

    async def bind() -> CorpusBinding:
        return CorpusBinding(link.fanout, one, cat.geometry)

    b = cat.run(bind())
    link.corpora["c0"] = b
    try:
        seen = []
        for layer in range(4):  # forward 1
            seen.append(cat.run(cat.at_layer("c0", layer)).view)
            if layer == 1:
                cat.staged["c0"] = (b, two)
        assert all(v is one for v in seen) and "c0" in cat.staged  # no swap mid-forward
        assert cat.run(cat.at_layer("c0", 0)).view.same_table(two)  # forward 2
        assert cat.staged == {} and cat._following is None  # -1: no re-read task
        assert cat.run(cat.at_layer("c0", 1)).view.same_table(two)

        b.dead = {0}  # a holder that failed a call stays failed in the adopted view
        cat.staged["c0"] = (b, one)
        assert cat.run(cat.at_layer("c0", 0)).dead == {0}

        cat.staged["c0"] = (cat.run(bind()), two)  # for a binding no longer the link's
        assert cat.run(cat.at_layer("c0", 0)).view.same_table(one) and cat.staged == {}
    finally:
        link.close()
