"""The shared fan-out engine (requester/fanout.py) against a plain torch reference, with fake holder
routes: grouping by holder and the LSE merge are exact; a failed holder's rows fail over to
replicas, then to a re-read page table, then to a local re-prefill, in that order, and only then
is the corpus unavailable. The same engine serves corpusd's worker and the SGLang plugin."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch

from corpusd.kernels.reference import partial_attention
from corpusd.model import DeepseekV32
from corpusd.rpc import StatusError
from corpusd.testing.numeric import rel
from indexer import index_scores
from indexer.modes import local_topk
from indexer.select import select_topk
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.fanout import CorpusBinding, Fanout
from requester.holder_client import Partial
from requester.metrics import RequesterMetrics
from requester.plan import Geometry
from requester.predicate import Group, Predicate, Profile
from requester.sources import LocalRows

P = 4  # tokens per page
T = 22  # six pages, the last one partial
GEO = Geometry(
    heads=2,
    kv_dim=12,
    d_v=8,
    index_dim=4,
    index_topk=8,
    index_arith="exact",
    softmax_scale=0.3,
    dtype=torch.float32,
)


class FakeRoute:
    """A holder's Attend over its own pool: pool rows must arrive as int32, as a holder's kernel
    takes them; ``down`` makes every call fail as a dead holder's gRPC call does."""

    name = "grpc"

    def __init__(self, pool: torch.Tensor, d_v: int) -> None:
        self.pool, self.d_v, self.down, self.calls = pool, d_v, False, 0
        self.keys: dict[int, torch.Tensor] = {}  # page → its index keys [P, D_I]

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise _dead()

    async def index_keys(self, corpus_id: str, layer: int) -> dict[int, torch.Tensor]:
        self._check()
        return dict(self.keys)

    async def index_topk(self, corpus_id: str, layer: int, *args: Any) -> Any:
        self._check()  # every page it holds is a candidate (score: its first key's first entry)
        pos = torch.tensor([pg * P for pg in sorted(self.keys)])
        scores = torch.stack([self.keys[pg][0, 0] for pg in sorted(self.keys)])
        return pos[None], scores[None]

    async def attend_rows(
        self, corpus_id: str, layer: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
        timeout: float | None = None,
    ) -> Partial:  # fmt: skip
        self.calls += 1
        if self.down:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        assert rows.dtype == torch.int32, rows.dtype
        o, lse = partial_attention(q, self.pool, rows, scale, self.d_v)
        return Partial(o, lse, "torch", 0.0)

    async def close(self) -> None:
        pass


class _Dead(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

    def details(self) -> str:
        return "connection refused"


def _dead() -> grpc.aio.AioRpcError:
    """What a gRPC call to a killed holder raises."""
    return _Dead()


def placed(
    rows: torch.Tensor,
    holders: tuple[str, ...],
    replicas: list[list[int]],
    keys: torch.Tensor | None = None,
) -> tuple[CorpusView, dict[str, FakeRoute]]:
    """A view of corpus ``rows [T, kv_dim]`` whose page ``p`` has a replica on each holder
    index in ``replicas[p]``, and each holder's pool (frames in order of arrival)."""
    d = rows.shape[1]
    n_pages = -(-rows.shape[0] // P)
    padded = torch.zeros(n_pages * P, d)
    padded[: rows.shape[0]] = rows
    frames: dict[int, list[int]] = {h: [] for h in range(len(holders))}
    reps = []
    for p in range(n_pages):
        here = []
        for h in replicas[p]:
            here.append((h, len(frames[h])))
            frames[h].append(p)
        reps.append(tuple(here))
    routes = {}
    for h, pages in frames.items():
        pool = torch.cat([padded[p * P : (p + 1) * P] for p in pages]) if pages else padded[:0]
        routes[holders[h]] = FakeRoute(pool, GEO.d_v)
        if keys is not None:
            routes[holders[h]].keys = {p: keys[p * P : (p + 1) * P] for p in pages}
    zeros = torch.zeros(n_pages, dtype=torch.int64)
    view = CorpusView("c0", rows.shape[0], P, holders, zeros, zeros, tuple(reps))
    return view.failover(()), routes


def engine(routes: dict[str, FakeRoute]) -> Fanout:
    f = Fanout(Predicate(Profile(), "route"), RequesterMetrics())
    f.routes.update(routes)  # type: ignore[arg-type]
    f.clients.update(routes)  # type: ignore[arg-type]  # index keys and top-k, as a client
    return f


def inputs(seed: int, n: int = 5, k: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(T, GEO.kv_dim, generator=g)
    q = torch.randn(n, GEO.heads, GEO.kv_dim, generator=g)
    canon = torch.randint(-1, T, (n, k), generator=g)
    return rows, q, canon


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def count(f: Fanout, pick: str, to: str) -> float:
    return f.metrics.fallbacks.labels(pick, to)._value.get()


def test_attend_groups_by_holder_and_merges_exactly() -> None:
    rows, q, canon = inputs(0)
    view, routes = placed(rows, ("a", "b", "c"), [[p % 3] for p in range(6)])
    b = CorpusBinding(engine(routes), view, GEO)
    o, lse = run(b.attend(0, q, canon))
    ro, rl = partial_attention(q, rows, canon, GEO.softmax_scale, GEO.d_v)
    assert rel(o, ro) < 1e-5 and torch.allclose(lse, rl, atol=1e-5)
    assert all(r.calls == 1 for r in routes.values())  # one call per holder per layer call


def test_a_failed_holder_fails_over_to_replicas_with_the_same_result() -> None:
    rows, q, canon = inputs(1)
    view, routes = placed(rows, ("a", "b", "c"), [[p % 3, (p + 1) % 3] for p in range(6)])
    f = engine(routes)
    b = CorpusBinding(f, view, GEO)
    want = run(b.attend(0, q, canon))
    routes["b"].down = True
    got = run(b.attend(0, q, canon))
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.equal(
        got[1].isinf(), want[1].isinf()
    )
    assert b.dead == {1} and 1 not in b.view.page_holder.tolist()
    assert count(f, "route", "replica") == 1
    calls = routes["b"].calls
    run(b.attend(0, q, canon))  # bound to the replicas from now on
    assert routes["b"].calls == calls


def test_no_replica_left_re_reads_the_page_table() -> None:
    """Both replicas of some pages are down; the coordinator's page table now places the corpus
    on a third holder: the binding re-reads it and serves the rows there."""
    rows, q, canon = inputs(2)
    view, routes = placed(rows, ("a", "b"), [[0, 1]] * 6)
    moved, moved_routes = placed(rows, ("c",), [[0]] * 6)
    routes.update(moved_routes)
    reads: list[int] = []

    async def refresh() -> CorpusView:
        reads.append(1)
        return moved

    f = engine(routes)
    b = CorpusBinding(f, view, GEO, refresh=refresh)
    routes["a"].down = routes["b"].down = True
    o, lse = run(b.attend(0, q, canon))
    ro, rl = partial_attention(q, rows, canon, GEO.softmax_scale, GEO.d_v)
    assert rel(o, ro) < 1e-5 and torch.allclose(lse, rl, atol=1e-5)
    assert b.view.holders == ("c",) and not b.dead and reads
    assert count(f, "route", "table") >= 1


def test_without_replica_table_or_tokens_the_corpus_is_unavailable() -> None:
    rows, q, canon = inputs(3)
    view, routes = placed(rows, ("a", "b"), [[p % 2] for p in range(6)])
    b = CorpusBinding(engine(routes), view, GEO)
    routes["a"].down = True
    said = r"holder a failed \(UNAVAILABLE: connection refused\) and its rows have no other"
    with pytest.raises(CorpusUnavailable, match=said):
        run(b.attend(0, q, canon))


def test_an_unchanged_page_table_is_not_retried_forever() -> None:
    rows, q, canon = inputs(4)
    view, routes = placed(rows, ("a",), [[0]] * 6)
    reads: list[int] = []

    async def refresh() -> CorpusView:
        reads.append(1)
        return view  # the coordinator still names the dead holder

    b = CorpusBinding(engine(routes), view, GEO, refresh=refresh)
    routes["a"].down = True
    with pytest.raises(CorpusUnavailable):
        run(b.attend(0, q, canon))
    assert len(reads) == 1


def test_last_resort_reads_the_page_store_before_recomputing(tiny_model: DeepseekV32) -> None:
    """Every holder down, and the process has the page store: the rows are read from it (the
    pages the holder loaded; ``store``), not re-prefilled, and equal the holders'."""
    geo = Geometry.of(tiny_model)
    g = torch.Generator().manual_seed(6)
    layer = 1
    rows = torch.randn(T, geo.kv_dim, generator=g)
    view, routes = placed(rows, ("a",), [[0]] * 6)
    routes["a"].d_v = geo.d_v
    f = engine(routes)
    read: list[tuple[int, list[int]]] = []
    padded = torch.zeros(view.n_pages * P, geo.kv_dim)  # the store keeps whole pages
    padded[:T] = rows

    def stored(li: int, pages: list[int]) -> torch.Tensor:
        read.append((li, pages))
        return torch.stack([padded[p * P : (p + 1) * P] for p in pages])

    b = CorpusBinding(f, view, geo, model=tiny_model, tokens=torch.zeros(T), stored=stored)
    routes["a"].down = True
    q = torch.randn(3, geo.heads, geo.kv_dim, generator=g)
    canon = torch.randint(-1, T, (3, 7), generator=g)
    with torch.inference_mode():
        o, lse = run(b.attend(layer, q, canon))
        run(b.attend(layer, q, canon))  # pages read once, then from the page cache
    ro, rl = partial_attention(q, rows, canon, geo.softmax_scale, geo.d_v)
    assert rel(o, ro) < 1e-5 and torch.allclose(lse, rl, atol=1e-5)
    assert count(f, "route", "store") == 2 and count(f, "route", "local") == 0
    assert len(read) == 1 and read[0][0] == layer and b.local is None  # nothing recomputed


def test_last_resort_recomputes_the_rows_here(tiny_model: DeepseekV32) -> None:
    """Every holder down and no other table: the rows are re-prefilled from the corpus's tokens
    (``local``), which give the same rows the holders had."""
    geo = Geometry.of(tiny_model)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, tiny_model.cfg.vocab_size, (T,), generator=g)
    ref = LocalRows(tiny_model, tokens)
    with torch.inference_mode():
        ref.ensure(T)
    layer = 1
    rows = ref.cache.latent[layer][:T].clone()
    view, routes = placed(rows, ("a",), [[0]] * 6)
    routes["a"].d_v = geo.d_v
    f = engine(routes)
    b = CorpusBinding(f, view, geo, model=tiny_model, tokens=tokens)
    routes["a"].down = True
    q = torch.randn(3, geo.heads, geo.kv_dim, generator=g)
    canon = torch.randint(-1, T, (3, 7), generator=g)
    with torch.inference_mode():
        o, lse = run(b.attend(layer, q, canon))
    ro, rl = partial_attention(q, rows, canon, geo.softmax_scale, geo.d_v)
    assert rel(o, ro) < 1e-5 and torch.allclose(lse, rl, atol=1e-5)
    assert count(f, "route", "local") == 1


def test_offsets_rotate_the_query_back_for_route(tiny_model: DeepseekV32) -> None:
    """A corpus placed at offset o: the query's rope band is rotated by −o before it goes to the
    holder (the holder is position-oblivious); at offset 0 the query goes as it is."""
    geo = Geometry.of(tiny_model)
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(T, geo.kv_dim, generator=g)
    view, routes = placed(rows, ("a",), [[0]] * 6)
    routes["a"].d_v = geo.d_v
    seen: list[torch.Tensor] = []
    real: Callable[..., Any] = routes["a"].attend_rows

    async def spy(corpus_id: str, layer: int, q: torch.Tensor, *a: Any, **kw: Any) -> Partial:
        seen.append(q)
        return await real(corpus_id, layer, q, *a, **kw)

    routes["a"].attend_rows = spy  # type: ignore[method-assign]
    b = CorpusBinding(engine(routes), view, geo)
    q = torch.randn(2, geo.heads, geo.kv_dim, generator=g)
    canon = torch.randint(0, T, (2, 5), generator=g)
    run(b.attend(0, q, canon, offsets=torch.tensor([0, 7])))
    assert torch.equal(seen[0][0], q[0])
    assert torch.equal(seen[0][1], geo.canonical(q[1:], torch.tensor([7]), geo.d_v)[0])
    assert not torch.equal(seen[0][1, :, geo.d_v :], q[1, :, geo.d_v :])
    assert torch.equal(seen[0][1, :, : geo.d_v], q[1, :, : geo.d_v])


def test_index_keys_come_once_from_live_holders_and_skip_a_dead_one() -> None:
    """Replica index keys: a page's keys are streamed once (a holder whose pages all came
    already is not asked), and a holder that is already down when the corpus is bound is failed
    over: its pages' keys come from replicas."""
    rows, _, _ = inputs(7)
    keys = torch.randn(6 * P, GEO.index_dim)
    placing = [[p % 3, (p + 1) % 3] for p in range(6)]  # a: 0 2 3 5, b: 0 1 3 4, c: 1 2 4 5
    view, routes = placed(rows, ("a", "b", "c"), placing, keys)
    got = run(CorpusBinding(engine(routes), view, GEO).index_keys(0))
    assert torch.equal(got, keys[:T]) and [r.calls for r in routes.values()] == [1, 1, 0]

    view, routes = placed(rows, ("a", "b", "c"), placing, keys)
    f = engine(routes)
    b = CorpusBinding(f, view, GEO)
    routes["a"].down = True
    got = run(b.index_keys(0))
    assert (
        torch.equal(got, keys[:T])
        and b.dead == {0}
        and [r.calls for r in routes.values()] == [1, 1, 1]
    )
    assert 0 not in b.view.page_holder.tolist()
    assert (
        count(f, "index", "replica") == 1
        and f.metrics.errors.labels("UNAVAILABLE")._value.get() == 1
    )


def test_distributed_top_k_leaves_out_a_dead_holder_whose_pages_have_replicas() -> None:
    rows, _, _ = inputs(8)
    keys = torch.randn(6 * P, GEO.index_dim)
    view, routes = placed(rows, ("a", "b", "c"), [[p % 3, (p + 1) % 3] for p in range(6)], keys)
    b = CorpusBinding(engine(routes), view, GEO)
    routes["c"].down = True
    iq, iw, limit = torch.zeros(1, 1, GEO.index_dim), torch.zeros(1, 1), torch.tensor([T])
    parts = run(b.holder_topk(0, iq, iw, limit))
    assert len(parts) == 2 and b.dead == {2}
    held = {int(x) for pos, _ in parts for x in pos[0]}
    assert held == {p * P for p in range(6)}  # every page still a candidate

    view, routes = placed(rows, ("a", "b"), [[p % 2] for p in range(6)], keys)
    b = CorpusBinding(engine(routes), view, GEO)
    routes["a"].down = True
    with pytest.raises(CorpusUnavailable, match="have no replica outside the failed holders"):
        run(b.holder_topk(0, iq, iw, limit))
    with pytest.raises(CorpusUnavailable, match="have no replica outside the failed holders"):
        run(CorpusBinding(engine(routes), view, GEO).index_keys(0))


def test_a_forced_primitive_that_cannot_serve_a_group_falls_back_counted() -> None:
    """The one decision rule of the host and plugin paths: a forced fetch whose pages do not
    fit, or a forced local without tokens, gives way to the cheapest primitive that can serve
    the group, and the engine counts the fallback; auto never picks what cannot serve."""
    shape = Group(n=2, k=8, h=2, rows=16, missing_pages=2, page_bytes=192, missing_tokens=0,
                  local_ok=False, kv_dim=12, d_v=8, fetch_ok=False)  # fmt: skip
    for force in ("fetch", "local"):
        engine = Fanout(Predicate(Profile(), force), RequesterMetrics(), transport="grpc")
        d = engine.decide(shape)
        assert (d.pick, d.fallback) == ("route", force), force
        assert engine.metrics.fallbacks.labels(force, "route")._value.get() == 1
    auto = Predicate(Profile(prefill_us_per_token=0.0, alpha_us=1e9), "auto").decide(shape)
    assert auto.pick == "route" and auto.fallback is None  # fetch and local: cost inf
    fits = Predicate(Profile(), "fetch").decide(replace(shape, fetch_ok=True))
    assert (fits.pick, fits.fallback) == ("fetch", None)  # forced and possible: obeyed


class TimedRoute(FakeRoute):
    """A FakeRoute that records the timeout each call was given."""

    def __init__(self, pool: torch.Tensor, d_v: int) -> None:
        super().__init__(pool, d_v)
        self.timeouts: list[float | None] = []

    async def attend_rows(
        self, corpus_id: str, layer: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
        timeout: float | None = None,
    ) -> Partial:  # fmt: skip
        self.timeouts.append(timeout)
        return await super().attend_rows(corpus_id, layer, q, rows, scale, timeout)


def test_the_holder_deadline_waits_out_each_new_shapes_warm_up() -> None:
    """The holder deadline (``--holder-deadline-s``) bounds a stopped holder's stall, and must
    not fail over a healthy one that compiles a kernel or captures a graph for a row count it
    has not served: on two H200s a 1 s deadline sent a GPU worker's calls of a new shape to
    local recompute (the same tokens, other bits). A call of a row bucket the holder answered
    before gets the deadline; the first of each new bucket gets ``rpc_timeout_s``."""
    rows, _, _ = inputs(0)
    view, fakes = placed(rows, ("a",), [[0] for _ in range(6)])
    f = Fanout(Predicate(Profile(), "route"), RequesterMetrics(), holder_deadline_s=0.5)
    f.routes.update(fakes)  # type: ignore[arg-type]
    f.clients.update(fakes)  # type: ignore[arg-type]
    b = CorpusBinding(f, view, GEO)

    def attend(n: int) -> None:
        _, q, canon = inputs(n, n=n)
        run(b.attend(0, q, canon))

    assert f.deadline("a", 2, "route") == 60.0  # nothing answered yet
    attend(2)
    assert f.deadline("a", 2, "route") == 0.5  # bucket 2 answered
    assert f.deadline("a", 3, "route") == 60.0 and f.deadline("a", 40, "route") == 60.0
    assert f.deadline("a", 2, "fetch") == 60.0  # another primitive warms up on its own
    attend(40)
    assert f.deadline("a", 33, "route") == 0.5 and f.deadline("a", 64, "route") == 0.5
    assert f.deadline("a", 65, "route") == 60.0
    assert sum(m.value for fam in f.metrics.errors.collect() for m in fam.samples) == 0


class SlowRoute(TimedRoute):
    """A holder that answers after ``delay_s`` (busy: its health check answers) or never (stopped:
    neither does its health check)."""

    def __init__(self, pool: torch.Tensor, d_v: int) -> None:
        super().__init__(pool, d_v)
        self.delay_s, self.stopped, self.probes = 0.0, False, 0

    async def attend_rows(
        self, corpus_id: str, layer: int, q: torch.Tensor, rows: torch.Tensor, scale: float,
        timeout: float | None = None,
    ) -> Partial:  # fmt: skip
        await asyncio.sleep(3600 if self.stopped else self.delay_s)
        return await super().attend_rows(corpus_id, layer, q, rows, scale, timeout)

    async def alive(self, timeout: float) -> bool:
        self.probes += 1
        if self.stopped:
            await asyncio.sleep(timeout)
        return not self.stopped


def test_past_the_deadline_a_busy_holder_is_waited_for_and_a_stopped_one_fails_over() -> None:
    """The deadline is a suspicion: a warmed-up holder past it that answers a health check is
    busy (on a fresh GPU machine a holder took over 1 s on a warm shape and two workers failed
    over: the same tokens, other bits), and its reply is used; one that does not answer
    either is stopped, and its rows go to the replica within the deadline plus the probe."""
    rows, q, canon = inputs(3)
    view, fakes = placed(rows, ("a", "b"), [[0, 1] for _ in range(6)])
    slow = SlowRoute(fakes["a"].pool, GEO.d_v)
    f = Fanout(Predicate(Profile(), "route"), RequesterMetrics(), holder_deadline_s=0.2)
    f.routes.update({"a": slow, "b": fakes["b"]})  # type: ignore[dict-item]
    f.clients.update({"a": slow, "b": fakes["b"]})  # type: ignore[dict-item]
    b = CorpusBinding(f, view, GEO)
    want = run(b.attend(0, q, canon))  # warms the shape up
    assert slow.calls == 1, "holder a serves some pages"
    slow.delay_s = 0.5  # busy: past the deadline, health answers
    got = run(b.attend(0, q, canon))
    assert slow.probes >= 1 and f.metrics.slow_calls.labels("route")._value.get() >= 1
    assert count(f, "route", "replica") == 0 and slow.calls == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    slow.stopped = True  # stopped: neither the call nor the health check answers
    b_calls = fakes["b"].calls
    t0 = time.monotonic()
    got = run(b.attend(0, q, canon))
    took = time.monotonic() - t0
    assert took < 0.2 + 0.5 + 0.5, f"a stopped holder stalled {took:.2f} s"
    assert count(f, "route", "replica") == 1 and fakes["b"].calls > b_calls
    assert f.metrics.errors.labels("DEADLINE_EXCEEDED")._value.get() == 1
    assert rel(got[0], want[0]) < 1e-6


class IndexRoute(FakeRoute):
    """A holder's IndexTopK over the index keys of the pages it holds, as a holder scores them:
    its local top-k (positions, scores), ``-1`` padded."""

    async def index_topk(  # type: ignore[override]
        self, corpus_id: str, layer: int, iq: torch.Tensor, iw: torch.Tensor,
        limit: torch.Tensor, k: int, arith: str = "exact",
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        self._check()
        pos = torch.cat([torch.arange(pg * P, pg * P + P) for pg in sorted(self.keys)])
        keys = torch.cat([self.keys[pg] for pg in sorted(self.keys)])
        keep = pos < T
        pos, keys = pos[keep], keys[keep]
        scores = index_scores(iq, iw, keys, GEO.index_dim**-0.5, arith).float()
        return local_topk(scores, pos, limit, k)


def test_the_distributed_indexer_keeps_a_failed_single_replica_holders_pages() -> None:
    """A holder with the only replica of its pages fails: its attention rows are read from the
    page store, and its pages must stay candidates of the distributed indexer too, scored here
    from the store's index keys. Before, the live holders' top-k alone was merged: the failed
    holder's keys were never selected again, and the agent decoded other tokens than
    transformers (CI, tests/procs/test_decode_oracle.py, 3 holders x 1 replica, a holder past
    its deadline on a loaded machine)."""
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(T, GEO.kv_dim, generator=g)
    keys = torch.randn(T + 2, GEO.index_dim, generator=g)  # the last page is partial
    view, fakes = placed(rows, ("a", "b"), [[p % 2] for p in range(6)], keys=keys)
    routes = {h: IndexRoute(r.pool, GEO.d_v) for h, r in fakes.items()}
    for h, r in fakes.items():
        routes[h].keys = r.keys
    f = engine(routes)  # type: ignore[arg-type]
    padded = torch.zeros(6 * P, GEO.index_dim)
    padded[: T + 2] = keys

    def stored_keys(layer: int, pages: list[int]) -> torch.Tensor:
        return torch.stack([padded[p * P : (p + 1) * P] for p in pages])

    iq = torch.randn(3, 2, GEO.index_dim, generator=g)
    iw = torch.randn(3, 2, generator=g)
    want = select_topk(
        index_scores(iq, iw, keys[:T], GEO.index_dim**-0.5, "exact").float(), GEO.index_topk
    )
    b = CorpusBinding(f, view, GEO, stored_keys=stored_keys)
    assert torch.equal(run(b.topk(0, iq, iw)), want)
    routes["b"].down = True
    assert torch.equal(run(b.topk(0, iq, iw)), want)  # b fails an index call: store
    assert count(f, "index", "store") >= 1
    # b failed an attention call first (as in CI): the binding marked it dead and reads its rows
    # from the store; the next step's top-k asks only a, and b's pages are scored here
    c = CorpusBinding(f, view, GEO, stored_keys=stored_keys)
    c.dead.add(view.holders.index("b"))
    assert torch.equal(run(c.topk(0, iq, iw)), want)
    # without a page store: refused, never a selection short of b's pages
    with pytest.raises(CorpusUnavailable, match="no replica outside the failed holders"):
        run(CorpusBinding(f, view, GEO).topk(0, iq, iw))
    d = CorpusBinding(f, view, GEO)
    d.dead.add(view.holders.index("b"))
    with pytest.raises(CorpusUnavailable, match="no page store here"):
        run(d.topk(0, iq, iw))
