"""The requester's pure parts against plain references: distributed top-k merge, the indexer
modes, rope shifts, attention over canonical rows, the page cache, the predicate, sampling."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from corpusd.kernels.reference import partial_attention
from corpusd.model.rope import Rotary, rotate_half_layout, shift_band
from corpusd.model.tiny import TINY
from corpusd.testing.numeric import rel
from indexer import merge_topk, select_topk
from indexer.modes import select_distributed, select_replica
from requester.plan import compact
from requester.predicate import Group, Predicate, Profile
from requester.sampling import SamplingParams, sample
from requester.sources import PageCache, attend_canonical


def _scores(n: int, t: int, levels: int, seed: int) -> torch.Tensor:
    """Scores with many exact ties (few distinct levels), so tie-breaking is exercised."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, (n, t), generator=g).float() / levels


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    t=st.integers(1, 300),
    k=st.integers(1, 64),
    parts=st.integers(1, 5),
    levels=st.sampled_from([2, 7, 1000]),
    seed=st.integers(0, 2**16),
)
def test_distributed_merge_equals_global_topk(
    n: int, t: int, k: int, parts: int, levels: int, seed: int
) -> None:
    scores = _scores(n, t, levels, seed)
    limit = torch.randint(0, t + 1, (n,), generator=torch.Generator().manual_seed(seed + 1))
    want = select_topk(scores, k, limit)
    owner = torch.randint(0, parts, (t,), generator=torch.Generator().manual_seed(seed + 2))
    pos, val = [], []
    for p in range(parts):
        cols = (owner == p).nonzero().squeeze(1)
        if cols.numel() == 0:
            continue
        local = select_topk(scores[:, cols], k, (cols[None, :] < limit[:, None]).sum(1))
        picked = torch.where(local >= 0, cols[local.clamp(min=0)], -1)
        pos.append(picked)
        val.append(torch.where(local >= 0, scores.gather(1, picked.clamp(min=0)), -math.inf))
        pos.append(picked)  # the same candidates again: a replica of these pages
        val.append(val[-1])
    got = merge_topk(torch.cat(pos, 1), torch.cat(val, 1), k)
    assert torch.equal(got, want), f"{n=} {t=} {k=} {parts=}"


@pytest.mark.parametrize("offset", [0, 5, 40])
def test_indexer_modes_select_like_the_full_sequence(offset: int) -> None:
    """Replica and distributed give the logical-order top-k over prefix ‖ corpus ‖ suffix."""
    t, p_len, n, k = 200, offset + 30, 6, 48
    full = _scores(n, t + p_len, 9, offset)  # logical order
    corpus = full[:, offset : offset + t]
    private = torch.cat([full[:, :offset], full[:, offset + t :]], 1)
    pos = torch.tensor([offset + t + 29 - i * 4 for i in range(n)])
    want = select_topk(full, k, pos + 1)
    assert torch.equal(select_replica(private, corpus, offset, pos, k), want)
    limit = (pos - offset + 1).clamp(0, t)
    halves = [torch.arange(0, t, 2), torch.arange(1, t, 2)]
    parts = []
    for cols in halves:
        local = select_topk(corpus[:, cols], k, (cols[None, :] < limit[:, None]).sum(1))
        c = torch.where(local >= 0, cols[local.clamp(min=0)], -1)
        parts.append((c, torch.where(c >= 0, corpus.gather(1, c.clamp(min=0)), -math.inf)))
    logical = torch.cat([torch.arange(offset), torch.arange(offset + t, offset + t + 30)])
    got = select_distributed(private, logical, parts, offset, pos, k)
    assert torch.equal(got, want)


def test_rope_shift_composes_and_moves_queries_or_keys_alike() -> None:
    rot = Rotary(TINY)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g, dtype=torch.float64)
    a, b = torch.tensor([3, 100, 7, 0, 4000]), torch.tensor([-3, 17, 900, 5, -1000])
    once = shift_band(x, 0, 64, *rot.shift(a + b))
    twice = shift_band(shift_band(x, 0, 64, *rot.shift(a)), 0, 64, *rot.shift(b))
    assert rel(twice, once) < 1e-4  # float32 angles: p · inv_freq rounds at ~1e-7 · p
    q, k = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    o = torch.tensor([37, 64, 1000, 1, 65000])
    q_back = shift_band(q, 0, 64, *rot.shift(-o))
    k_fwd = shift_band(k, 0, 64, *rot.shift(o))
    assert torch.allclose((q_back * k).sum(-1), (q * k_fwd).sum(-1), rtol=1e-4, atol=1e-4)
    assert torch.equal(rotate_half_layout(q, *rot.shift(torch.zeros(5))), q)


def test_attend_canonical_matches_reference_over_shifted_rows() -> None:
    g = torch.Generator().manual_seed(1)
    rot = Rotary(TINY)
    u, n, h, k = 90, 4, 8, 20
    uniq = torch.randperm(1000, generator=g)[:u].sort().values
    rows = torch.randn(u, 576, generator=g)
    q = torch.randn(n, h, 576, generator=g)
    canon = uniq[torch.randint(0, u, (n, k), generator=g)]
    canon[0, 5:] = -1
    canon[3] = -1  # a row with nothing: LSE -inf, O 0
    offsets = torch.tensor([0, 37, 37, 5])
    o, lse = attend_canonical(q, canon, offsets, rows, uniq, rot.shift, 0.1, 512)
    for i in range(n):
        kv = shift_band(rows, 512, 64, *rot.shift(torch.full((u,), int(offsets[i]))))
        idx = torch.where(canon[i] >= 0, torch.searchsorted(uniq, canon[i].clamp(min=0)), -1)
        ro, rl = partial_attention(q[i : i + 1], kv, idx[None], 0.1, 512)
        assert torch.allclose(o[i], ro[0], atol=1e-5), f"row {i}"
        assert torch.allclose(lse[i], rl[0], atol=1e-5), f"row {i}"
    assert torch.isinf(lse[3]).all() and not o[3].any()


def test_compact_moves_selected_entries_first() -> None:
    mask = torch.tensor([[False, True, False, True], [False] * 4, [True, False, False, False]])
    vals = torch.arange(12).view(3, 4)
    keep, (out,) = compact(mask, vals)
    assert keep.tolist() == [0, 2]
    assert out.tolist() == [[1, 3], [8, -1]]


def test_page_cache_evicts_least_recently_used() -> None:
    page = torch.zeros(4, 8)
    cache = PageCache(page_size=4, capacity_bytes=2 * page.nbytes)
    cache.put(0, [0, 1], torch.stack([page, page + 1]))
    cache.rows(0, torch.tensor([5]))  # position 5 is on page 1: page 0 is now the oldest
    cache.put(0, [5], (page + 5)[None])
    assert cache.missing(0, [0, 1, 5]) == [0]
    got = cache.rows(0, torch.tensor([4, 21, 7]))
    assert got[:, 0].tolist() == [1.0, 5.0, 1.0]


def test_predicate_picks_by_cost_and_respects_force(tmp_path: Path) -> None:
    prof = Profile(alpha_us=500, beta_bytes_per_us=1000, prefill_us_per_token=1000)
    cold = Group(
        n=8,
        k=2048,
        h=64,
        rows=8 * 2048,
        missing_pages=500,
        page_bytes=147456,
        missing_tokens=32000,
        local_ok=True,
    )
    warm = Group(
        n=1,
        k=64,
        h=64,
        rows=64,
        missing_pages=0,
        page_bytes=147456,
        missing_tokens=0,
        local_ok=True,
    )
    auto = Predicate(prof)
    assert auto.decide(cold).pick == "route"
    assert auto.decide(warm).pick in ("fetch", "local")  # rows already here: no round trip
    assert Predicate(prof, "fetch").decide(cold).pick == "fetch"
    assert auto.costs(replace(warm, local_ok=False))["local"] == math.inf
    with pytest.raises(ValueError, match="primitive"):
        Predicate(prof, "teleport")
    path = tmp_path / "profile.json"
    prof.save(path)
    assert Profile.load(path) == prof
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a corpusd calibration profile"):
        Profile.load(path)
    with pytest.raises(ValueError, match="beta"):
        Profile(beta_bytes_per_us=0)


def test_sampling_greedy_nucleus_and_seeded() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(), g) == 1
    tight = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sample(logits, tight, g) for _ in range(20)} == {1}
    hot = SamplingParams(temperature=5.0, seed=3)
    a = [sample(logits, hot, torch.Generator().manual_seed(3)) for _ in range(5)]
    b = [sample(logits, hot, torch.Generator().manual_seed(3)) for _ in range(5)]
    assert a == b
    draws = {sample(logits, hot, g) for _ in range(200)}
    assert len(draws) >= 3, "temperature 5 should spread over the vocabulary"
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_fit_line_stays_non_negative() -> None:
    from requester.calibrate import fit_line

    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    base, slope = fit_line([1, 2, 3], [5, 4, 3])  # noise: shrinking times
    assert base == 0 and slope > 0


def test_the_client_is_importable_from_the_package() -> None:
    """``from requester import Client`` (issue 19: it failed, though the docs use it)."""
    import requester
    from requester import AgentError, Client
    from requester.client import Client as Direct

    assert Client is Direct and issubclass(AgentError, Exception)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = requester.Nope  # type: ignore[attr-defined]
