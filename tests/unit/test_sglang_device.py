"""The SGLang plugin's device path against corpusd's torch reference (CPU; no sglang needed):
the fused exact top-k, the arena (SGLang's index-k pages, request slots) and the routing of
corpus positions to holder frames and back through the LSE merge."""

from __future__ import annotations

import math

import pytest
import torch

from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel
from indexer import select_topk
from indexer.fp8 import fp8_view
from indexer.scores import index_scores
from requester.corpus_view import CorpusView
from requester.sglang import device, device_scores, pagehash, topk
from requester.sglang.binding import CorpusBindingError
from requester.sglang.resident import FailedOver, Resident, index_pages
from tests.unit.test_table_refresh import TWO

SEED = 20261124


def _tied_scores(g: torch.Generator, n: int, m: int, levels: int = 7) -> torch.Tensor:
    """Scores with many exact ties (few distinct values), some -0.0 beside +0.0."""
    s = torch.randint(-levels, levels + 1, (n, m), generator=g).float() / 4
    s[s == 0] = torch.where(torch.rand((n, m), generator=g)[s == 0] < 0.5, -0.0, 0.0)
    return s


def _ascending(cols: torch.Tensor) -> torch.Tensor:
    """A selection in select_topk's order: ascending, -1 last."""
    big = torch.iinfo(torch.int64).max
    out = torch.where(cols >= 0, cols, big).sort(dim=1).values
    return torch.where(out == big, -1, out)


def _sglang_want(s: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """topk.sglang_topk's selection without the non-candidates the device path never takes
    (invalid, NaN, -inf; stock takes them only when a row has too few others), ascending."""
    ok = valid & ~torch.isnan(s) & (s != -math.inf)
    lengths = torch.full((s.shape[0],), s.shape[1])
    want = topk.sglang_topk(s.masked_fill(~ok, -math.inf), lengths, k)
    keep = ok.gather(1, want.clamp(min=0)) & (want >= 0)
    return _ascending(torch.where(keep, want, -1))


@pytest.mark.parametrize("m,k", [(300, 64), (50, 64), (2048, 2048), (1, 4)])
def test_exact_topk_is_sglang_topk(m: int, k: int) -> None:
    """SGLang's order (its float bits: -0.0 below +0.0), the lowest column among equal bits; and
    where no -0.0 is in play, exactly corpusd's own select_topk."""
    g = torch.Generator().manual_seed(SEED + m)
    for trial in range(4):
        s = _tied_scores(g, 9, m) if trial % 2 == 0 else torch.randn(9, m, generator=g)
        valid = torch.rand(9, m, generator=g) < 0.8
        valid[0] = False  # a row with no candidate
        s[1, :3] = -math.inf  # -inf scores are never chosen by either
        got = _ascending(device.exact_topk(s, valid, k))
        assert torch.equal(got, _sglang_want(s, valid, k)), f"{m=}, {k=}, {trial=}"
        plus = s + 0.0  # -0.0 → +0.0: then the two rules agree
        want = select_topk(plus.masked_fill(~valid, -math.inf), k)
        assert torch.equal(_ascending(device.exact_topk(plus, valid, k)), want), f"{m=}, {k=}"
    # Without the column in the low bits ties would be broken by topk's order: check the keys
    # really are distinct per column.
    keys = device.order_keys(torch.zeros(2, 10), torch.ones(2, 10, dtype=torch.bool))
    assert keys[0].unique().numel() == 10 and bool((keys[0, :-1] > keys[0, 1:]).all())


def test_plus_zero_beats_minus_zero_as_in_sglang() -> None:
    """A defect of the device path until it ranked raw bits: -0.0 and +0.0 tied there (lowest
    column won), while SGLang's kernel ranks +0.0 strictly higher."""
    s = torch.tensor([[-0.0, -0.0, 0.0, -1.0]])
    got = device.exact_topk(s, torch.ones_like(s, dtype=torch.bool), 1)
    assert got.tolist() == [[2]]


def test_exact_topk_ignores_nan() -> None:
    s = torch.tensor([[1.0, math.nan, 3.0, 2.0]])
    got = device.exact_topk(s, torch.ones_like(s, dtype=torch.bool), 3)
    assert _ascending(got).tolist() == [[0, 2, 3]]


def test_fused_topk_is_sglang_topk_over_the_logical_row() -> None:
    g = torch.Generator().manual_seed(SEED)
    n, wc, wo, k = 7, 320, 96, 128
    corpus_len = torch.tensor([0, 1, 100, 320, 319, 200, 64])
    own_len = torch.tensor([5, 96, 0, 30, 96, 1, 64])
    cs, os_ = _tied_scores(g, n, wc), _tied_scores(g, n, wo)
    # Garbage past each row's lengths (the kernels leave it there): never selected.
    garbage = torch.arange(wc)[None] >= corpus_len[:, None]
    cs = cs.masked_fill(garbage, 1e9)
    os_ = os_.masked_fill(torch.arange(wo)[None] >= own_len[:, None], math.nan)
    cpos, own = device.fused_topk(cs, corpus_len, os_, own_len, k)
    for i in range(n):
        t, o = int(corpus_len[i]), int(own_len[i])
        logical = torch.cat([cs[i, :t], os_[i, :o]])[None]
        want = topk.sglang_topk(logical, torch.tensor([t + o]), k)
        want_c, want_o = topk.split_selection(want, torch.tensor([t]))
        got_c = cpos[i][cpos[i] >= 0].sort().values
        got_o = own[i][own[i] >= 0].sort().values
        assert torch.equal(got_c, want_c[want_c >= 0].sort().values), f"row {i}"
        assert torch.equal(got_o.long(), want_o[want_o >= 0].sort().values), f"row {i}"
    assert own.dtype == torch.int32 and cpos.shape == own.shape == (n, k)


def test_index_pages_are_sglang_pages_and_score_as_fp8_view() -> None:
    g = torch.Generator().manual_seed(SEED)
    p, d, t = 64, 128, 150
    keys = torch.randn(t, d, generator=g)
    pages = index_pages(keys, p, ue8m0=False)
    assert pages.shape == (3, p * (d + 4)) and pages.dtype == torch.uint8
    for i in range(2):  # full pages: byte-equal to the page SGLang's store writes
        assert torch.equal(pages[i], pagehash.index_k_page(keys[i * p : (i + 1) * p]))
    # Scores through the arena equal corpusd's fp8 reference over the same keys.
    n, h = 5, 16
    q = torch.randn(n, h, d, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(n, h, generator=g)
    table = torch.tensor([[0, 1, 2]] * n, dtype=torch.int32)
    got = device_scores.paged_scores_reference(q, w, pages, table, p)[:, :t]
    want = index_scores(q.float(), w, fp8_view(keys, False), 1.0)
    assert rel(got, want) < 1e-5


def _view(cid: str, tokens: int, holders: tuple[str, ...], g: torch.Generator) -> CorpusView:
    n_pages = math.ceil(tokens / 64)
    page_holder = torch.randint(0, len(holders), (n_pages,), generator=g)
    page_frame = torch.randperm(40, generator=g)[:n_pages]
    reps = tuple(((int(h), int(f)),) for h, f in zip(page_holder, page_frame, strict=True))
    return CorpusView(cid, tokens, 64, holders, page_holder, page_frame, reps)


def _resident(**kw: int) -> Resident:
    args = dict(
        n_layers=2,
        page_size=64,
        index_dim=128,
        arena_tokens=1024,
        window_tokens=512,
        req_slots=16,
    )
    args.update(kw)
    return Resident(**args, device="cpu", ue8m0=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage_rows", [0, 2], ids=["in-place", "staged"])
def test_corpus_partial_routes_rows_to_their_holders_and_merges_exactly(stage_rows: int) -> None:
    """Two pools: a kernel call each merged by LSE, or (staged, one of them a peer GPU's) one
    copy and one call, 2 query rows a copy; either equals the corpus attended in one piece."""
    g = torch.Generator().manual_seed(SEED)
    res = _resident(stage_rows=stage_rows)
    rows, d = 40 * 64, 576
    pools = {a: [torch.randn(rows, d, generator=g) for _ in range(2)] for a in ("h0", "h1")}
    for a, layers in pools.items():  # staged: h1 mapped as a peer GPU's pool
        res.add_pool(a, layers, "cuda_p2p" if stage_rows and a == "h1" else "cuda_ipc")
    assert res.staged == bool(stage_rows)
    other = _view("other", 100, ("h1",), g)  # a first corpus, so the second's base is not 0
    view = _view("c", 300, ("h1", "h0"), g)  # its holder index order differs from the slots
    keys = [torch.randn(300, 128, generator=g) for _ in range(2)]
    res.load(other, [torch.randn(100, 128, generator=g) for _ in range(2)])
    c = res.load(view, keys)
    assert c.base_page == 2 and c.n_pages == 5
    # Request slots 3 and 5 bound to "c", slot 4 unbound.
    res.bind(torch.tensor([3, 4, 5]), [c, None, c])
    base, tokens = res.rows_of(torch.tensor([3, 4, 5]))
    assert base.tolist() == [2, 0, 2] and tokens.tolist() == [300, 0, 300]

    n, h, k = 3, 8, 48
    q = torch.randn(n, h, d, generator=g)
    pos = torch.stack([torch.randperm(300, generator=g)[:k] for _ in range(n)])
    pos[1] = -1  # the unbound row selected nothing of a corpus
    pos[2, :10] = -1
    layer, scale = 1, d**-0.5
    o, lse = device.corpus_partial(res, layer, q, pos, base, scale, 512, base2=False)
    # Reference: the corpus laid out canonically (page p of "c" = frame of its holder's pool).
    canon = torch.cat(
        [
            pools[view.holders[int(view.page_holder[p])]][layer][
                int(view.page_frame[p]) * 64 : int(view.page_frame[p]) * 64 + 64
            ]
            for p in range(view.n_pages)
        ]
    )
    want_o, want_l = partial_attention(q, canon, pos, scale, 512)
    fin = torch.isfinite(want_l)
    assert rel(o, want_o) < 1e-5 and rel(lse[fin], want_l[fin]) < 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(want_l)) and bool((o[1] == 0).all())
    # The arena holds the corpus's keys where the block table says.
    table = res.block_table(base)
    assert table.shape == (3, 8) and int(table.max()) <= res.arena_pages - 1
    assert torch.equal(res.pages[0][2:7], index_pages(keys[0], 64, False))


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_staged_partial_copies_every_pools_rows_once_and_attends_them_as_in_place(
    chunk: int,
) -> None:
    """A pool on another GPU: the selected rows of three pools copied into one buffer, ``chunk``
    query rows a time, then one partial over it, equal to the partial over the rows in place."""
    g = torch.Generator().manual_seed(SEED + chunk)
    n, h, k, d, size = 3, 4, 40, 80, 128
    pools = [torch.randn(size, d, generator=g) for _ in range(3)]
    holder = torch.randint(-1, 3, (n, k), generator=g).to(torch.int32)
    rows = torch.where(holder >= 0, torch.randint(0, size, (n, k), generator=g), -1)
    rows = rows.to(torch.int32)
    rows[1] = -1  # a row that selected nothing
    holder[1] = -1
    q = torch.randn(n, h, d, generator=g)
    scale, d_v = d**-0.5, 64

    def partial(qq: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor):  # type: ignore[no-untyped-def]
        return device.sparse_partial(qq, kv, idx, scale, d_v, base2=False)

    o, lse = device.staged_partial(pools, q, holder, rows, chunk, partial)
    # in place: the three pools laid end to end, each entry's row offset by its pool's start
    flat = torch.cat(pools)
    where = torch.where(rows >= 0, holder.long() * size + rows.long(), -1)
    want_o, want_l = partial_attention(q, flat, where, scale, d_v)
    fin = torch.isfinite(want_l)
    assert rel(o, want_o) < 1e-5 and rel(lse[fin], want_l[fin]) < 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(want_l)) and bool((o[1] == 0).all())


@pytest.mark.parametrize("stage_rows", [0, 2])
def test_one_call_attends_own_tokens_and_corpus_rows_as_one_softmax_in_sglangs_layout(
    stage_rows: int,
) -> None:
    """One fused top-k list per row, each slot an own token (a row of SGLang's cache) or a
    corpus position (a holder's row, stored in corpusd's layout): the one call equals the exact
    attention over both sides with every key in SGLang's layout, and equals the two calls it
    replaces (corpus partial in corpusd's layout merged with the own partial by LSE). Rows past
    the corpus selection's (a graph's padding) attend their own tokens only."""
    from requester.sglang.lse import merge_local_corpus
    from requester.sglang.positions import to_corpusd_layout, to_sglang_layout

    g = torch.Generator().manual_seed(SEED + 7)
    d, d_v, t, k, m, n, h = 576, 512, 300, 48, 4, 3, 8
    res = _resident(stage_rows=stage_rows, one_call=True)  # type: ignore[arg-type]
    pools = {a: [torch.randn(40 * 64, d, generator=g) for _ in range(2)] for a in ("h0", "h1")}
    for a, layers in pools.items():
        res.add_pool(a, layers)
    view = _view("c", t, ("h1", "h0"), g)
    c = res.load(view, [torch.randn(t, 128, generator=g) for _ in range(2)])
    layer = 1
    canon = torch.cat([
        pools[view.holders[int(view.page_holder[p])]][layer][
            int(view.page_frame[p]) * 64 : int(view.page_frame[p]) * 64 + 64
        ]
        for p in range(view.n_pages)
    ])[:t]  # fmt: skip
    own_kv = torch.randn(200, 1, d, generator=g)  # SGLang's cache rows (its layout)
    own_rows = torch.randint(0, 200, (m, k), generator=g).to(torch.int32)
    positions = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(n)])
    is_own = torch.rand(m, k, generator=g) < 0.3  # each slot is one side or the other
    own_rows = torch.where(is_own, own_rows, -1)
    positions = torch.where(is_own[:n], -1, positions)
    positions[1, 30:] = -1  # fewer than k selected
    own_rows[2] = -1  # a row with corpus keys only
    q = torch.randn(m, h, d, generator=g)  # SGLang's layout
    base = torch.full((n,), c.base_page, dtype=torch.int32)
    scale = d**-0.5
    o, lse = device.one_call_partial(res, layer, q, own_kv, own_rows, positions, base, scale,
                                     d_v, base2=False)  # fmt: skip
    # exact: every key in SGLang's layout, the corpus's first, then the own rows
    keys = torch.cat([to_sglang_layout(canon), own_kv[:, 0]])
    pos = torch.cat([positions, torch.full((m - n, k), -1)])
    where = torch.where(own_rows >= 0, t + own_rows.long(), pos)
    want_o, want_l = partial_attention(q, keys, where, scale, d_v)
    fin = torch.isfinite(want_l)
    assert rel(o, want_o) < 1e-5 and rel(lse[fin], want_l[fin]) < 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(want_l))
    # the two calls it replaces
    res.one_call = False
    o_c, l_c = device.corpus_partial(res, layer, to_corpusd_layout(q[:n]), positions, base,
                                     scale, d_v, base2=False)  # fmt: skip
    o_own, l_own = partial_attention(q[:n], own_kv[:, 0], own_rows[:n], scale, d_v)
    two, _ = merge_local_corpus(o_own, l_own, o_c, l_c)
    assert rel(o[:n], two) < 1e-5


def test_staged_partial_of_no_rows_is_empty() -> None:
    pools = [torch.randn(64, 80), torch.randn(64, 80)]
    none = torch.zeros(0, 16, dtype=torch.int32)

    def partial(qq: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor):  # type: ignore[no-untyped-def]
        return device.sparse_partial(qq, kv, idx, 0.1, 64, base2=False)

    o, lse = device.staged_partial(pools, torch.zeros(0, 4, 80), none, none, 8, partial)
    assert o.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_the_corpus_partial_stages_with_a_peer_pool_when_set() -> None:
    g = torch.Generator().manual_seed(SEED)
    layers = [torch.randn(64, 576, generator=g) for _ in range(2)]
    res = _resident(stage_rows=32)
    res.add_pool("h0", layers)
    res.add_pool("h1", layers)
    assert not res.staged  # pools on its own GPU are read in place (one may hold every page)
    res.add_pool("h2", layers, transport="cuda_p2p")
    assert res.staged
    off = _resident(stage_rows=0)
    off.add_pool("h0", layers)
    off.add_pool("h1", layers, transport="cuda_p2p")
    assert not off.staged


def test_resident_refuses_what_it_cannot_serve_and_changes_nothing() -> None:
    g = torch.Generator().manual_seed(SEED)
    res = _resident(arena_tokens=512, window_tokens=256)
    res.add_pool("h0", [torch.zeros(64 * 40, 576) for _ in range(2)])
    keys = [torch.randn(300, 128) for _ in range(2)]
    with pytest.raises(CorpusBindingError, match="scores at most 256"):
        res.load(_view("big", 300, ("h0",), g), keys)
    with pytest.raises(CorpusBindingError, match="neither on this GPU nor on a GPU it reaches"):
        res.load(_view("far", 200, ("h0", "elsewhere:1"), g), [k[:200] for k in keys])
    res.load(_view("a", 256, ("h0",), g), [k[:256] for k in keys])
    res.load(_view("b", 256, ("h0",), g), [k[:256] for k in keys])
    with pytest.raises(CorpusBindingError, match="arena pages"):
        res.load(_view("c", 10, ("h0",), g), [k[:10] for k in keys])
    assert sorted(res.corpora) == ["a", "b"] and res._next_page == 8
    assert int((res.page_holder >= 0).sum()) == 8


def test_an_engine_pins_index_pages_are_placed_as_they_are() -> None:
    """An engine pin's pages (uint8, as SGLang computed them) go into the arena byte for byte;
    float keys are quantised there. Both forms of the same keys give the same arena."""
    g = torch.Generator().manual_seed(SEED)
    keys = [torch.randn(150, 128, generator=g) for _ in range(2)]
    view = _view("e", 150, ("h0",), g)
    from_keys, from_pages = _resident(), _resident()
    for res in (from_keys, from_pages):
        res.add_pool("h0", [torch.zeros(40 * 64, 576) for _ in range(2)])
    a = from_keys.load(view, keys)
    pages = [index_pages(k, 64, False) for k in keys]
    pages[1][0, :8] ^= 1  # bytes no quantisation of keys[1] makes: they must arrive unchanged
    b = from_pages.load(view, pages)
    for layer in range(2):
        got = from_pages.pages[layer][b.base_page : b.base_page + b.n_pages]
        assert torch.equal(got, pages[layer]), layer
    want = from_keys.pages[0][a.base_page : a.base_page + a.n_pages]
    assert torch.equal(from_pages.pages[0][b.base_page : b.base_page + b.n_pages], want)


def test_the_arena_maps_each_pages_first_replica_never_a_load_replicas_copy() -> None:
    """A corpus bound while a load replica of it exists (its view routes pages 1 and 3 to the
    copy): the arena reads every page from the placement's frame, which outlives the copy, and
    a copy on a holder not on this GPU does not refuse the binding."""
    two = CorpusView.from_page_table(TWO)  # type: ignore[arg-type]
    assert two.page_holder.tolist() == [0, 1, 0, 1]  # the view spreads over the copy
    keys = [torch.randn(two.token_count, 128) for _ in range(2)]
    both, here = _resident(), _resident()
    for res, mapped in ((both, ("addr-b", "addr-a")), (here, ("addr-a",))):
        for a in mapped:
            res.add_pool(a, [torch.zeros(40 * 64, 576) for _ in range(2)])
        c = res.load(two, keys)
        span = slice(c.base_page, c.base_page + c.n_pages)
        assert res.page_holder[span].tolist() == [res.holder_slot["addr-a"]] * 4
        assert res.page_frame[span].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("n", [1, 3, 4, 5, 11])
def test_in_row_chunks_calls_with_a_fixed_row_count_and_keeps_each_rows_output(n: int) -> None:
    """DeepGEMM's scoring outside a graph runs in chunks of one row count (one JIT compile for
    every prefill size): each call sees exactly ``rows`` rows, the padding gets the fill values,
    and the output rows are the unchunked call's, in order."""
    g = torch.Generator().manual_seed(SEED)
    pages = index_pages(torch.randn(300, 128, generator=g), 64, ue8m0=False)
    q = torch.randn(n, 8, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(n, 8, generator=g)
    table = torch.randint(0, 5, (n, 5), generator=g, dtype=torch.int32)
    lens = torch.randint(1, 320, (n,), generator=g, dtype=torch.int32)
    seen = []

    def score(
        q: torch.Tensor, w: torch.Tensor, t: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        seen.append((q.shape[0], w.shape[0], t.shape[0], lens.shape[0]))
        real = min(4, n - 4 * (len(seen) - 1))
        assert bool((lens[real:] == 1).all()) and bool((w[real:] == 0).all())
        return device_scores.paged_scores_reference(q, w, pages, t, 64) + lens[:, None]

    got = device_scores.in_row_chunks(score, 4, (q, w, table, lens), (0, 0.0, 0, 1))
    want = device_scores.paged_scores_reference(q, w, pages, table, 64) + lens[:, None]
    assert seen == [(4, 4, 4, 4)] * math.ceil(n / 4)
    assert got.shape == want.shape and torch.equal(got, want)


def test_corpus_scores_of_no_rows_is_an_empty_window() -> None:
    res = _resident()
    q = torch.zeros(0, 8, 128).to(torch.float8_e4m3fn)
    empty = torch.zeros(0, dtype=torch.int32)
    got = device_scores.corpus_scores(res, 0, q, torch.zeros(0, 8), empty, empty)
    assert got.shape == (0, res.window_tokens)


@pytest.mark.parametrize("stage_rows", [0, 2], ids=["in-place", "staged"])
def test_a_failed_over_plan_moves_the_arenas_reads_to_the_replicas_between_steps(
    stage_rows: int,
) -> None:
    """A corpus whose pages each sit on both holders of this GPU: the arena first reads each
    page where the page table placed it; the device plan failed over from holder h0 (applied
    between steps) reads every page from h1's copy, with the same partial, and h0's rows no
    longer count (overwritten, the output does not change). Read in place or staged."""
    g = torch.Generator().manual_seed(SEED)
    res = _resident(stage_rows=stage_rows)
    d, frames = 576, (3, 7, 1, 5)
    canon = torch.randn(len(frames) * 64, d, generator=g)
    pools: dict[str, list[torch.Tensor]] = {}
    for a, offset in (("h0", 0), ("h1", 10)):  # h1 keeps its copy 10 frames further on
        pool = torch.zeros(40 * 64, d)
        for p, f in enumerate(frames):
            pool[(f + offset) * 64 : (f + offset + 1) * 64] = canon[p * 64 : (p + 1) * 64]
        pools[a] = [pool, pool.clone()]  # staged: h1 mapped as a peer GPU's pool
        res.add_pool(a, pools[a], "cuda_p2p" if stage_rows and a == "h1" else "cuda_ipc")
    assert res.staged == bool(stage_rows)
    replicas = tuple(((p % 2, f + 10 * (p % 2)), (1 - p % 2, f + 10 * (1 - p % 2)))
                     for p, f in enumerate(frames))  # fmt: skip
    first = [r[0] for r in replicas]
    view = CorpusView("c", len(frames) * 64, 64, ("h0", "h1"),
                      torch.tensor([h for h, _ in first]), torch.tensor([f for _, f in first]),
                      replicas, pinned=2)  # fmt: skip
    c = res.load(view, [torch.randn(view.token_count, 128, generator=g) for _ in range(2)])
    span = slice(c.base_page, c.base_page + c.n_pages)
    assert res.page_holder[span].tolist() == [0, 1, 0, 1]
    n, h, k = 3, 8, 40
    q = torch.randn(n, h, d, generator=g)
    pos = torch.stack([torch.randperm(view.token_count, generator=g)[:k] for _ in range(n)])
    base = torch.full((n,), c.base_page, dtype=torch.int32)
    scale = d**-0.5
    want = partial_attention(q, canon, pos, scale, 512)
    before = device.corpus_partial(res, 1, q, pos, base, scale, 512, base2=False)
    res.forget("c")  # retired: an admitted request still reads it, so it fails over too
    assert res.fail_over({"h0"}) == [FailedOver("c", replica=2, kept=0)]
    assert res.page_holder[span].tolist() == [1] * 4
    assert res.page_frame[span].tolist() == [13, 7 + 10, 11, 5 + 10]
    assert res.retired["c"].placement == c.placement  # the page table's, for the recheck
    assert res.fail_over({"h0"}) == []  # once
    pools["h0"][1].normal_(generator=g)  # a failed holder's pool: its rows no longer count
    after = device.corpus_partial(res, 1, q, pos, base, scale, 512, base2=False)
    for o, lse in (before, after):
        assert rel(o, want[0]) < 1e-5 and rel(lse, want[1]) < 1e-6
