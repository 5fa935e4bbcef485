"""The LSE merge of partial attentions, and the indexer's deterministic exact top-k."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import indexer.select
from corpusd.kernels.merge import merge_partials
from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel
from indexer import index_scores, select_topk, select_topk_exact


def _inputs(seed: int, n: int = 5, h: int = 8, rows: int = 300, k: int = 64):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, 576, generator=g)
    kv = torch.randn(rows, 576, generator=g)
    idx = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(n)])
    return q, kv, idx


def test_partial_attention_equals_dense_softmax() -> None:
    q, kv, idx = _inputs(0)
    scale = 576**-0.5
    o, lse = partial_attention(q, kv, idx, scale, 512)
    rows = kv[idx]  # [n, k, 576]
    s = torch.einsum("nhd,nkd->nhk", q.double(), rows.double()) * scale
    ref_o = torch.einsum("nhk,nkv->nhv", s.softmax(-1), rows[..., :512].double())
    assert rel(o, ref_o) <= 1e-6
    assert rel(lse, torch.logsumexp(s, -1)) <= 1e-6


def test_partial_attention_row_chunks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import corpusd.kernels.reference as partial

    q, kv, idx = _inputs(2, n=9)
    whole = partial_attention(q, kv, idx, 0.1, 512)
    monkeypatch.setattr(partial, "_GATHER_ELEMS", 2 * 64 * 576)  # two rows per chunk
    chunked = partial_attention(q, kv, idx, 0.1, 512)
    # Not bit for bit: a bmm over 9 rows and one over 2 may block their sums differently (seen
    # on an AVX-512 Xeon), so each row agrees to fp32 rounding. A chunk that took the wrong rows,
    # indices or scores would be off by O(1).
    assert rel(whole[0], chunked[0]) <= 1e-6 and rel(whole[1], chunked[1]) <= 1e-6
    assert torch.equal(torch.isinf(whole[1]), torch.isinf(chunked[1]))


def test_partial_attention_empty_rows_and_padding() -> None:
    q, kv, idx = _inputs(1)
    idx[0] = -1  # an all-invalid row
    idx[1, 10:] = -1  # a padded row equals the same row over its valid prefix only
    o, lse = partial_attention(q, kv, idx, 0.1, 512)
    assert torch.all(o[0] == 0) and torch.all(torch.isneginf(lse[0]))
    o1, lse1 = partial_attention(q[1:2], kv, idx[1:2, :10], 0.1, 512)
    assert rel(o[1], o1[0]) <= 1e-6 and rel(lse[1], lse1[0]) <= 1e-6
    with pytest.raises(IndexError, match="out of range"):
        partial_attention(q, kv, torch.full_like(idx, kv.shape[0]), 0.1, 512)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), parts=st.integers(1, 5), data=st.data())
def test_merge_over_any_partition_equals_monolithic(
    seed: int, parts: int, data: st.DataObject
) -> None:
    q, kv, idx = _inputs(seed)
    scale = 576**-0.5
    whole = partial_attention(q, kv, idx, scale, 512)
    # Assign every selected slot to one part; some parts (or some rows of a part) end up empty.
    owner = torch.tensor(
        data.draw(st.lists(st.integers(0, parts - 1), min_size=idx.shape[1], max_size=idx.shape[1]))
    )
    pieces = []
    for p in range(parts):
        sub = torch.where(owner[None, :] == p, idx, -1)
        pieces.append(partial_attention(q, kv, sub, scale, 512))
    order = data.draw(st.permutations(range(parts)))
    o, lse = merge_partials([pieces[i] for i in order])
    assert rel(o, whole[0]) <= 1e-5
    assert rel(lse, whole[1]) <= 1e-6


def test_merge_of_all_empty_parts_is_empty_and_order_free() -> None:
    o = torch.zeros(2, 3, 512)
    empty = (o, torch.full((2, 3), float("-inf")))
    out, lse = merge_partials([empty, empty])
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    q, kv, idx = _inputs(3)
    a = partial_attention(q, kv, idx[:, :30], 0.2, 512)
    b = partial_attention(q, kv, idx[:, 30:], 0.2, 512)
    e = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    results = [merge_partials(list(p)) for p in itertools.permutations([a, b, e])]
    for o2, l2 in results[1:]:
        assert rel(o2, results[0][0]) <= 1e-6 and rel(l2, results[0][1]) <= 1e-6
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


def _reference_topk(scores: torch.Tensor, k: int, limit: torch.Tensor) -> list[list[int]]:
    out = []
    for row, lim in zip(scores.tolist(), limit.tolist(), strict=True):
        cand = sorted(range(int(lim)), key=lambda t: (-row[t], t))[:k]
        out.append(sorted(cand) + [-1] * (k - len(cand)))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 40), levels=st.integers(2, 50))
def test_select_topk_is_exact_and_ties_go_to_lowest_position(
    seed: int, k: int, levels: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    t = 60
    # Few distinct values: many ties, also at the cut.
    scores = torch.randint(0, levels, (7, t), generator=g).float()
    limit = torch.randint(1, t + 1, (7,), generator=g)
    got = select_topk(scores, k, limit)
    assert got.tolist() == _reference_topk(scores, k, limit)
    # a scorer that masked causality itself (-inf past the limit): the unsorted path
    masked = scores.masked_fill(torch.arange(t)[None, :] >= limit[:, None], float("-inf"))
    assert select_topk(masked, k).tolist() == _reference_topk(scores, k, limit)


def test_select_topk_without_limit_and_k_beyond_length() -> None:
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0]])
    assert select_topk(scores, 2).tolist() == [[0, 2]]
    assert select_topk(scores, 6).tolist() == [[0, 1, 2, 3, -1, -1]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_topk_fast_path_equals_exact_on_prefill_shaped_rows(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk: 64 rows at positions 3000…3063 over 3064 keys, continuous scores with
    planted ties at the cut, NaN, ±inf and a row with fewer eligible keys than k. The fast path
    must give the exact reference's answer bit for bit, and decide most rows itself."""
    g = torch.Generator().manual_seed(seed)
    n, t, k = 64, 3064, 128
    scores = torch.randn(n, t, generator=g)
    limit = torch.arange(t - n, t) + 1
    limit[5] = 100  # fewer eligible keys than k
    top = scores[7].topk(k + 1).indices
    scores[7, top[-1]] = scores[7, top[-2]]  # a tie straddling the cut
    scores[9, 17] = float("nan")
    scores[11, 40] = float("inf")
    scores[13, :200] = float("-inf")
    want = select_topk_exact(scores, k, limit)
    slow_rows = []
    real = indexer.select.select_topk_exact

    def counting(s: torch.Tensor, kk: int, lim: torch.Tensor | None = None) -> torch.Tensor:
        slow_rows.append(s.shape[0])
        return real(s, kk, lim)

    monkeypatch.setattr(indexer.select, "select_topk_exact", counting)
    got = select_topk(scores, k, limit)
    assert torch.equal(got, want), f"{(got != want).any(dim=1).nonzero().flatten().tolist()=}"
    assert sum(slow_rows) <= 6, f"{slow_rows=}: the fast path decided too few rows"
    no_limit = select_topk(scores, k)
    assert torch.equal(no_limit, real(scores, k))
    # the masking scorer's output through the unsorted path: same answer, as few slow rows
    slow_rows.clear()
    masked = scores.masked_fill(torch.arange(t)[None, :] >= limit[:, None], float("-inf"))
    got = select_topk(masked, k)
    assert torch.equal(got, want), f"{(got != want).any(dim=1).nonzero().flatten().tolist()=}"
    assert sum(slow_rows) <= 6, f"{slow_rows=}: the fast path decided too few rows"


def test_index_scores_match_formula_across_key_blocks() -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 16, generator=g)
    w = torch.randn(3, 4, generator=g)
    keys = torch.randn(9000, 16, generator=g)  # crosses the 4096-key block boundary
    got = index_scores(q, w, keys, 0.25)
    ref = torch.einsum(
        "nh,nht->nt",
        w.double(),
        torch.relu(0.25 * torch.einsum("nhd,td->nht", q.double(), keys.double())),
    )
    assert rel(got, ref) <= 1e-6
    limit = torch.tensor([0, 8999, 4500])
    masked = index_scores(q, w, keys, 0.25, limit=limit)
    past = torch.arange(9000)[None, :] >= limit[:, None]
    assert bool(masked[past].eq(float("-inf")).all()) and torch.equal(masked[~past], got[~past])
