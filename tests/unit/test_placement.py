"""Placement as pure functions: hypothesis properties against brute force on small instances."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.placement import HolderLoad, NoFit, apply, place, waterfill
from corpusd.coordinator.sessions import NoWorker, WorkerLoad, choose_home


@st.composite
def cluster(draw: st.DrawFn, max_holders: int = 6, max_cap: int = 40) -> list[HolderLoad]:
    n = draw(st.integers(1, max_holders))
    out = []
    for i in range(n):
        cap = draw(st.integers(1, max_cap))
        out.append(HolderLoad(f"h{i}", cap, draw(st.integers(0, cap))))
    return out


def check(holders: list[HolderLoad], pages: int, replicas: int) -> None:
    """The invariants every placement keeps, whatever the objective."""
    p = place(holders, pages, replicas)
    by_id = {h.holder_id: h for h in holders}
    for hid, mine in p.shards.items():
        assert len(mine) <= by_id[hid].free, f"{hid} over capacity: {len(mine)=} {by_id[hid]=}"
        assert len(set(mine)) == len(mine), f"{hid} holds a page twice: {mine}"
    assert len(p.table) == pages
    for page, reps in enumerate(p.table):
        assert len(reps) == replicas and len(set(reps)) == replicas, f"{page=} {reps=}"
        assert all(page in p.shards[h] for h in reps)
    assert sum(map(len, p.shards.values())) == pages * replicas
    after = {h.holder_id: h for h in apply(holders, p)}
    assert all(h.used <= h.capacity for h in after.values())
    assert p.peak == max(after[h].used for h in p.shards)


@settings(max_examples=300, deadline=None)
@given(cluster(), st.integers(1, 60), st.integers(1, 3))
def test_capacity_is_never_exceeded_and_replicas_land_on_distinct_holders(
    holders: list[HolderLoad], pages: int, replicas: int
) -> None:
    try:
        check(holders, pages, replicas)
    except NoFit:
        assume(False)


@settings(max_examples=300, deadline=None)
@given(cluster(), st.integers(1, 60), st.integers(1, 3))
def test_a_pin_is_admitted_exactly_when_aggregate_free_frames_suffice(
    holders: list[HolderLoad], pages: int, replicas: int
) -> None:
    # A holder takes at most one copy of a page, so aggregate room is Σ min(free, pages).
    room = sum(min(h.free, pages) for h in holders)
    fits = replicas <= len(holders) and room >= pages * replicas
    try:
        place(holders, pages, replicas, cp_degree=1)
        placed = True
    except NoFit as e:
        placed = False
        never = replicas > len(holders) or sum(min(h.capacity, pages) for h in holders) < (
            pages * replicas
        )
        assert e.permanent == never, (str(e), holders)
    assert placed == fits, f"{holders=} {pages=} {replicas=}"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.integers(2, 30), st.data())
def test_fragmented_free_space_still_admits_a_pin_no_single_holder_could_take(
    n: int, free: int, data: st.DataObject
) -> None:
    holders = [HolderLoad(f"h{i}", 64, 64 - free) for i in range(n)]
    pages = data.draw(st.integers(free + 1, n * free))  # larger than any one holder's room
    p = place(holders, pages, 1, cp_degree=1)
    assert p.cp_degree >= 2 and p.degree_limit >= 2
    check(holders, pages, 1)


def brute_force_peak(holders: list[HolderLoad], demand: int, pages: int, k: int) -> int | None:
    """Min over every integer allocation on at most ``k`` holders of the receivers' peak."""
    rooms = [min(h.free, pages) for h in holders]
    best = None
    for amounts in itertools.product(*(range(r + 1) for r in rooms)):
        if sum(amounts) != demand or sum(a > 0 for a in amounts) > k:
            continue
        peak = max(h.used + a for h, a in zip(holders, amounts, strict=True) if a > 0)
        best = peak if best is None else min(best, peak)
    return best


@settings(max_examples=250, deadline=None)
@given(cluster(max_holders=4, max_cap=9), st.integers(1, 9), st.integers(1, 4), st.data())
def test_waterfill_peak_is_the_brute_force_minimum_for_the_degree(
    holders: list[HolderLoad], pages: int, k: int, data: st.DataObject
) -> None:
    replicas = data.draw(st.integers(1, 2))
    demand = pages * replicas
    best = brute_force_peak(holders, demand, pages, k)
    try:
        amounts = waterfill(holders, demand, pages, k)
    except NoFit:
        assert best is None, f"brute force found peak {best} for {holders=} {demand=} {k=}"
        return
    assert best is not None and len(amounts) <= k and sum(amounts.values()) == demand
    used = {h.holder_id: h.used for h in holders}
    peak = max(used[h] + a for h, a in amounts.items())
    assert peak == best, f"{amounts=} peak {peak} vs optimum {best}: {holders=} {demand=} {k=}"


def test_waterfill_fills_the_least_loaded_first() -> None:
    holders = [HolderLoad("a", 100, 50), HolderLoad("b", 100, 10), HolderLoad("c", 100, 0)]
    assert waterfill(holders, 30, 30, 2) == {"b": 10, "c": 20}  # level 20 on the two emptiest
    assert waterfill(holders, 90, 90, 3) == {"b": 40, "c": 50}  # level 50: "a" is already there
    assert waterfill(holders, 121, 121, 3) == {"a": 10, "b": 50, "c": 61}  # level 61, 2 trimmed


def test_cp_degree_spreads_a_long_corpus_and_replicas_multiply_it() -> None:
    holders = [HolderLoad(f"h{i}", 1000, 0) for i in range(8)]
    assert place(holders, 64, 1, cp_degree=4).cp_degree == 4
    assert place(holders, 64, 2, cp_degree=2).cp_degree == 4
    assert place(holders, 64, 1, cp_degree=16).cp_degree == 8  # capped by the holders
    with pytest.raises(NoFit, match="replicas 9 > 8"):
        place(holders, 64, 9)


def test_cp_buckets_defaults_profile_and_bad_profiles(tmp_path: Path) -> None:
    b = CpBuckets.load()
    assert b.degree(1) == 1 and b.degree(10**9) == b.bounds[-1][1] > 1
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"alpha_us": 12.0, "cp_buckets": [[100, 1], [1000, 2], [None, 4]]}))
    b = CpBuckets.load(prof)
    assert [b.degree(t) for t in (100, 101, 1000, 1001)] == [1, 2, 2, 4]
    for bad, msg in [
        ({"other": 1}, "must be a list"),
        ({"cp_buckets": []}, "empty"),
        ({"cp_buckets": [[100, 2], [50, 4]]}, "ascending"),
        ({"cp_buckets": [[None, 2], [50, 4]]}, "only the last"),
        ({"cp_buckets": [[100, 0]]}, "cp_degree must be"),
    ]:
        prof.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=msg):
            CpBuckets.load(prof)
    with pytest.raises(ValueError, match="cannot read"):
        CpBuckets.load(tmp_path / "missing.json")


@st.composite
def workers(draw: st.DrawFn) -> list[WorkerLoad]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        mb, kc = draw(st.integers(1, 16)), draw(st.integers(100, 10_000))
        out.append(WorkerLoad(f"w{i}", draw(st.integers(0, mb)), mb, draw(st.integers(0, kc)), kc))
    return out


@settings(max_examples=300, deadline=None)
@given(workers(), st.integers(0, 2000))
def test_home_worker_minimises_the_larger_of_batch_and_kv_fraction(
    ws: list[WorkerLoad], tokens: int
) -> None:
    fit = [w for w in ws if w.fits(tokens)]
    if not fit:
        with pytest.raises(NoWorker):
            choose_home(ws, tokens)
        return
    chosen = next(w for w in ws if w.worker_id == choose_home(ws, tokens))
    assert chosen.fits(tokens)
    assert max(chosen.after(tokens)) == min(max(w.after(tokens)) for w in fit)


def test_home_worker_balances_batches_when_kv_is_even() -> None:
    ws = [WorkerLoad("a", 5, 8, 0, 1000), WorkerLoad("b", 2, 8, 0, 1000)]
    assert choose_home(ws) == "b"
    # b has the smaller batch but its suffix KV is nearly full: a wins the dual balance
    ws = [WorkerLoad("a", 5, 8, 0, 1000), WorkerLoad("b", 2, 8, 950, 1000)]
    assert choose_home(ws, session_tokens=40) == "a"
