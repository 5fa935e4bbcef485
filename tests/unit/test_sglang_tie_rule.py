"""SGLang's NSA top-k tie rule, from its kernel, against route's (``requester/sglang/topk.py``).

The rule (sgl-kernel ``csrc/elementwise/topk.cu``, read at sgl-project/sglang@06c48ca; the
kernel SGLang 0.5.10.post1 calls through ``fast_topk_v2`` / ``fast_topk_transform_fused``):
scores rank by their float32 bits (``convert_to_uint32``, lines 71–74); a row of length ≤ k
takes every position (lines 36–41); an exact tie at the cut goes to the candidates whose
``atomicAdd(&s_last_remain, -1)`` arrives first (lines 218–222), i.e. to no fixed position.
:func:`radix_topk` below transcribes the kernel's passes in plain Python with the atomics'
arrival order as an argument, so the tests can state what *any* run of stock may return and
check that route's choice is one of them.
"""

from __future__ import annotations

import math

import pytest
import torch

from requester.sglang import device, topk

SEED = 20261127
SMEM_INPUT_SIZE = 32 * 1024 * 4 // (2 * 4)  # kSmem / (2 · sizeof(int))


def _u8(x: float) -> int:
    """``convert_to_uint8``: the float's half-precision (round to nearest even) order bits >> 8."""
    bits = int(torch.tensor([x], dtype=torch.float32).half().view(torch.int16)[0]) & 0xFFFF
    key = (~bits & 0xFFFF) if bits & 0x8000 else (bits | 0x8000)
    return key >> 8


def radix_topk(row: torch.Tensor, length: int, k: int, arrival: list[int]) -> set[int]:
    """``fast_topk_cuda_tl`` / ``naive_topk_cuda`` for one row, with every shared-memory atomic
    served in the order ``arrival`` (a permutation of ``range(length)``) lists the positions.
    Returns the selected positions."""
    if length <= k:
        return set(range(length))
    key32 = topk.sglang_order(row[:length]).tolist()
    order = [i for i in arrival if i < length]
    hist = [0] * 256
    for i in order:
        hist[_u8(float(row[i]))] += 1
    chosen: set[int] = set()

    def threshold(h: list[int], need: int) -> int:  # the bin where the cumulative sum crosses
        above = 0
        for b in range(255, -1, -1):
            if above + h[b] >= need:
                return b
            above += h[b]
        raise AssertionError("fewer candidates than k")

    need = k
    t = threshold(hist, need)
    need -= sum(hist[t + 1 :])
    cand: list[int] = []
    for i in order:
        b = _u8(float(row[i]))
        if b > t:
            chosen.add(i)
        elif b == t and need and len(cand) < SMEM_INPUT_SIZE:
            cand.append(i)
    if need == 0:
        return chosen
    for rnd in range(4):
        shift = 24 - 8 * rnd
        hist = [0] * 256
        for i in cand:
            hist[(key32[i] >> shift) & 0xFF] += 1
        t = threshold(hist, need)
        need -= sum(hist[t + 1 :])
        nxt: list[int] = []
        for i in cand:  # arrival order is kept from pass to pass
            b = (key32[i] >> shift) & 0xFF
            if b > t:
                chosen.add(i)
            elif b == t and need:
                if rnd == 3:  # the tie at the cut: first come, first served
                    if len(nxt) < need:
                        nxt.append(i)
                elif len(nxt) < SMEM_INPUT_SIZE:
                    nxt.append(i)
        if rnd == 3 or need == 0:
            return chosen | (set(nxt) if rnd == 3 else set())
        cand = nxt
    return chosen


def _tied_row(g: torch.Generator, m: int) -> torch.Tensor:
    s = torch.randint(-6, 7, (m,), generator=g).float() / 8
    zero = s == 0
    s[zero] = torch.where(torch.rand(m, generator=g)[zero] < 0.5, -0.0, 0.0)
    return s


def test_sglang_order_is_the_kernels_bit_order() -> None:
    vals = [-math.inf, -2.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, math.inf, math.nan]
    keys = topk.sglang_order(torch.tensor(vals)).tolist()
    assert keys == sorted(keys) and len(set(keys)) == len(keys), keys
    assert keys[3] == 0x7FFFFFFF and keys[4] == 0x80000000  # -0.0 below +0.0


@pytest.mark.parametrize("m,k", [(300, 64), (64, 64), (40, 64), (1000, 256)])
def test_route_takes_a_set_stock_can_take_and_stock_varies_at_ties(m: int, k: int) -> None:
    """Over rows full of exact ties (±0.0 among them): every arrival order gives the strict top
    and fills the cut from the tied positions; route's choice is the ascending arrival order's;
    without a tie at the cut every arrival order gives route's set."""
    g = torch.Generator().manual_seed(SEED + m)
    varied = 0
    for trial in range(6):
        row = _tied_row(g, m) if trial % 2 == 0 else torch.randn(m, generator=g)
        length = m - trial  # some rows shorter than the width
        lengths = torch.tensor([length])
        route = set(topk.sglang_topk(row[None], lengths, k)[0].tolist()) - {-1}
        assert route == radix_topk(row, length, k, list(range(m))), f"{m=} {k=} {trial=}"
        tie = bool(topk.ties_at_cut(row[None], lengths, k)[0])
        sets = set()
        for _ in range(5):
            arrival = torch.randperm(m, generator=g).tolist()
            got = radix_topk(row, length, k, arrival)
            assert len(got) == min(k, length)
            sets.add(frozenset(got))
        if not tie:
            assert sets == {frozenset(route)}, f"{m=} {k=} {trial=}: no tie, yet sets differ"
        varied += len(sets) > 1
    if m > k:
        assert varied, "no trial had a tie at the cut: the test exercises nothing"


def test_device_topk_follows_the_rule_across_corpus_and_own() -> None:
    """fused_topk over [corpus ‖ own] is sglang_topk over the logical row, and a set the kernel
    can return over stock's row, which holds the same scores in the same order."""
    g = torch.Generator().manual_seed(SEED)
    n, wc, wo, k = 4, 200, 60, 96
    cs = torch.stack([_tied_row(g, wc) for _ in range(n)])
    os_ = torch.stack([_tied_row(g, wo) for _ in range(n)])
    clen = torch.tensor([200, 150, 0, 37])
    olen = torch.tensor([60, 10, 60, 1])
    cpos, own = device.fused_topk(cs, clen, os_, olen, k)
    for i in range(n):
        t, o = int(clen[i]), int(olen[i])
        row = torch.cat([cs[i, :t], os_[i, :o]])
        got = set(cpos[i][cpos[i] >= 0].tolist()) | {t + j for j in own[i][own[i] >= 0].tolist()}
        assert got == radix_topk(row, t + o, k, list(range(t + o))), f"row {i}"


def test_ties_at_cut_counts_only_a_tie_that_straddles_the_cut() -> None:
    s = torch.tensor([[3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 1.0, 1.0], [3.0, 0.0, -0.0, 1.0]])
    lengths = torch.tensor([4, 4, 4])
    assert topk.ties_at_cut(s, lengths, 2).tolist() == [True, False, False]
    assert topk.ties_at_cut(s, torch.tensor([2, 4, 4]), 2).tolist() == [False, False, False]
