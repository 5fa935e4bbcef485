"""The fan-out engine: one corpus binding's plan, shared by corpusd's worker and the SGLang plugin.

Per layer call (DESIGN.md, "One decode step", steps 2–6):
select → group by holder → route / fetch / local → concurrent fan-out → fail over → LSE merge.

- :class:`Fanout` is a process's engine: its holder connections (a client and a route transport
  per holder address), the predicate, the metrics and where blocking torch work runs.
- :class:`CorpusBinding` is what the process keeps of one bound corpus: its page table (a
  :class:`CorpusView`), fetched pages, the replica index keys, the tokens and re-prefilled rows
  for ``local``, and the holders that failed. Its :meth:`~CorpusBinding.attend` serves partial
  attention over canonical corpus positions; its :meth:`~CorpusBinding.index_keys` and
  :meth:`~CorpusBinding.holder_topk` are the two indexer modes' corpus side
  (:mod:`requester.binding_index`).

Its steps are public so the SGLang plugin's host path (:mod:`requester.sglang.host_path`), which
sends a layer's holder calls before SGLang's own partial and waits after it, runs on them instead
of a copy: :meth:`~CorpusBinding.plan` (group by holder), :meth:`Fanout.decide` (the predicate,
a forced primitive that cannot serve falling back, counted), :meth:`~CorpusBinding.serve` (one
group's route / fetch / local, failed over, recorded), :meth:`~CorpusBinding.pull` (a fetch's
pages) and :meth:`Fanout.record` (metrics, drift, trace). The device half, the plan a graph
captured on the GPU executes, is :mod:`requester.fanout_device`.

Failover, in one place (:meth:`CorpusBinding._recover`): a failed holder call marks the holder
dead and re-serves its rows from replicas on the others; when some page has no live replica the
binding re-reads its page table (``refresh``, where the binder gave one: the coordinator may have
placed the corpus anew), then reads the holder's pages from the page store it loaded them from
(``store``, where this process has the store: milliseconds) or recomputes the rows here from
the tokens (``local``: seconds to minutes, a prefill of the corpus up to the rows asked for),
and only then raises :class:`CorpusUnavailable`. A failed holder loses no data, so the result
is the same. A step's call to a holder that answered before has a deadline
(:meth:`Fanout.deadline`, ``--holder-deadline-s``): a stopped holder, which accepts and never
answers, fails over like a dead one instead of stalling its sessions for ``--rpc-timeout-s``.

Names: ``rows`` are pool rows on one holder (``frame * page_size + slot``, int32, what a
holder's Attend takes); ``positions`` / ``canon`` are canonical corpus positions (int64, the
corpus's first token at 0). ``-1`` marks an unused slot in both.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
import torch

from corpusd.kernels.reference import PartialOut
from corpusd.model import DeepseekV32
from corpusd.rpc import StatusError
from requester.balance import HolderSpeed
from requester.binding_index import CorpusIndexer
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.drift import Drift
from requester.metrics import RequesterMetrics
from requester.plan import Geometry, GroupWork, failure, group_shape, holder_groups, merge_groups
from requester.predicate import Decision, Group, Predicate
from requester.routes import Connections
from requester.sources import LocalRows, PageCache, attend_canonical

log = logging.getLogger("corpusd.requester")
T = TypeVar("T")
#: query rows per ``holder_deadline_s`` of a step's holder call (a decode step of a full batch
#: is one unit; a long prompt's prefill gets one per this many rows)
DEADLINE_ROWS = 256
#: seconds a holder past its deadline gets to answer a health check (:meth:`Fanout.bounded`)
PROBE_S = 0.5


def bucket(rows: int) -> int:
    """The power of two at or above ``rows``: the shapes a holder warms up once each."""
    return 1 << max(0, rows - 1).bit_length()


Offload = Callable[..., Awaitable[Any]]  # (fn, *args) → awaitable of fn(*args), off the loop
#: (layer, page numbers) → their latent rows ``[len(pages), P, kv_dim]`` as the page store has
#: them (what a holder loaded): the ``store`` fallback, blocking (run through ``offload``)
Stored = Callable[[int, list[int]], torch.Tensor]


def counted(d: Decision, metrics: RequesterMetrics) -> Decision:
    """``d``, with its fallback (a forced primitive that could not serve the group, which
    ``d.pick`` stands in for) counted in ``metrics``."""
    if d.fallback is not None:
        metrics.fallbacks.labels(d.fallback, d.pick).inc()
    return d


class Trace(Protocol):
    """Where recorded decisions go, one dict each (a list keeps them)."""

    def append(self, entry: dict[str, Any], /) -> None: ...


async def inline(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work on the caller's loop (a loop of its own, as the SGLang link's)."""
    return fn(*args)


class Fanout(Connections):
    """A process's fan-out engine: its holder connections (:class:`Connections`), the
    predicate, the metrics. Create and use it inside one running event loop.

    ``transport`` picks how routes reach each holder (``auto`` | ``grpc`` | ``nvshmem``, see
    :mod:`requester.routes`); ``offload`` runs blocking torch work (default: inline); ``trace``,
    when given (a list, or anything with ``append``), receives every decision with its predicted
    and measured cost (:meth:`record`)."""

    def __init__(
        self,
        predicate: Predicate,
        metrics: RequesterMetrics,
        *,
        transport: str = "auto",
        nvshmem_device: int = 0,
        rpc_timeout_s: float = 60.0,
        holder_deadline_s: float | None = None,
        fetch_cache_bytes: int = 1 << 30,
        offload: Offload = inline,
        trace: Trace | None = None,
    ) -> None:
        super().__init__(transport, nvshmem_device, metrics.transport)
        self.predicate, self.metrics, self.offload, self.trace = predicate, metrics, offload, trace
        self.rpc_timeout_s, self.fetch_cache_bytes = rpc_timeout_s, fetch_cache_bytes
        self.holder_deadline_s = holder_deadline_s
        # (holder, primitive, row bucket) a step's call answered: that shape is warmed up
        self.answered: set[tuple[str, str, int]] = set()
        self.step = 0  # the caller's step number, for logs and the trace
        self.drift = Drift(
            profile=predicate.profile.source,
            on_window=lambda p, r: metrics.ratio_median.labels(p).set(r),
            on_drift=lambda p, r: metrics.drift.labels(p).inc(),
        )

    async def bind(
        self,
        view: CorpusView,
        geometry: Geometry,
        *,
        model: DeepseekV32 | None = None,
        tokens: torch.Tensor | None = None,
        refresh: Callable[[], Awaitable[CorpusView]] | None = None,
        kv_format: str = "plain",
        stored: Stored | None = None,
        stored_keys: Stored | None = None,
    ) -> CorpusBinding:
        """A binding of the corpus ``view`` describes; route transports to its holders are
        chosen (NVSHMEM joined) now, before any decoding. ``model`` and ``tokens`` make
        ``local`` possible (re-prefill here, its rows in the pin's ``kv_format``); ``refresh``
        re-reads the page table on failover; ``stored`` reads pages from the page store (the
        ``store`` fallback), ``stored_keys`` their index keys (the distributed indexer's, for
        pages no live holder has)."""
        for address in view.holders:
            await self.route(address)
        return CorpusBinding(
            self, view, geometry, model=model, tokens=tokens, refresh=refresh,
            kv_format=kv_format, stored=stored, stored_keys=stored_keys,
        )  # fmt: skip

    def decide(self, shape: Group) -> Decision:
        """The predicate's pick for a group of ``shape``; a forced primitive that cannot serve
        it (:meth:`Predicate.decide`'s ``fallback``) is counted as a fallback."""
        return counted(self.predicate.decide(shape), self.metrics)

    def deadline(self, address: str, rows: int, pick: str = "route") -> float:
        """Seconds a step's ``pick`` call of ``rows`` query rows to ``address`` may take before
        the holder counts as failed: ``holder_deadline_s`` per DEADLINE_ROWS rows (at least
        once), capped by ``rpc_timeout_s``. ``rpc_timeout_s`` alone with no deadline set, or
        until the holder has answered a call of this primitive and row bucket (:func:`bucket`):
        a holder's kernels compile and its graphs capture per shape, and on a GPU a new shape's
        first call takes seconds on a healthy holder (it failed two GPU workers over to local
        recompute before). A SIGKILLed holder refuses at once; a stopped one accepts and never
        answers, and only this bounds its stall."""
        if self.holder_deadline_s is None or (address, pick, bucket(rows)) not in self.answered:
            return self.rpc_timeout_s
        scaled = self.holder_deadline_s * max(1.0, rows / DEADLINE_ROWS)
        return min(self.rpc_timeout_s, scaled)

    async def bounded(
        self, address: str, rows: int, pick: str, call: Callable[[float], Awaitable[T]]
    ) -> T:
        """``await call(timeout)`` for a step's ``pick`` call of ``rows`` rows to ``address``,
        with the holder deadline (:meth:`deadline`) as a suspicion, not a verdict: past it the
        holder's health service is asked (PROBE_S); one that answers is busy, not stopped (a
        GPU holder compiling a kernel for a new shape, a loaded machine), and the call goes on,
        up to ``rpc_timeout_s``. One that does not answer either is stopped or cut off: the
        call is cancelled and raises StatusError DEADLINE_EXCEEDED, and its rows fail over."""
        deadline = self.deadline(address, rows, pick)
        if deadline >= self.rpc_timeout_s:
            return await call(self.rpc_timeout_s)
        task = asyncio.ensure_future(call(self.rpc_timeout_s))
        give_up = time.monotonic() + self.rpc_timeout_s
        while True:
            done, _ = await asyncio.wait({task}, timeout=deadline)
            if done:
                return task.result()
            if time.monotonic() < give_up and await self.client(address).alive(PROBE_S):
                self.metrics.slow_calls.labels(pick).inc()
                continue
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise StatusError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"holder {address}: no {pick} reply within {deadline:g} s, and no answer to "
                f"a health check within {PROBE_S:g} s (stopped or cut off?)",
            )

    def warmed(self, address: str, rows: int, pick: str) -> None:
        """``address`` answered a ``pick`` call of ``rows`` rows: later ones get the deadline."""
        self.answered.add((address, pick, bucket(rows)))

    def failed(self, e: grpc.aio.AioRpcError | StatusError) -> tuple[grpc.StatusCode, str]:
        """Count a failed holder call (by status) and return its status and message."""
        code, detail = failure(e)
        self.metrics.errors.labels(code.name).inc()
        return code, detail

    def record(
        self, layer: int, g: GroupWork, d: Decision, measured_s: float, forced: bool, **extra: Any
    ) -> None:
        """Export one group's decision with its predicted and measured cost (metrics, drift, the
        debug log, and the trace when kept, with ``extra`` fields), so a user can see when the
        predicate was wrong. ``forced``: the pick was not the predicate's own choice."""
        e, m = self, self.metrics
        predicted_s = d.predicted_us[d.pick] / 1e6
        m.decided(d.pick, forced, layer, g.address)
        m.predicted.labels(d.pick).observe(predicted_s)
        m.measured.labels(d.pick).observe(measured_s)
        if predicted_s > 0 and math.isfinite(predicted_s):
            m.misprediction.labels(d.pick).set(measured_s / predicted_s)
        e.drift.observe(d.pick, measured_s, predicted_s)
        log.debug(
            "step %d layer %d holder %s rows %d: %s predicted %.0f µs (%s) measured %.0f µs",
            e.step, layer, g.address, len(g.keep), d.pick, d.predicted_us[d.pick],
            ", ".join(f"{k} {v:.0f}" for k, v in d.predicted_us.items()), measured_s * 1e6,
        )  # fmt: skip
        if e.trace is not None:
            e.trace.append({
                "step": e.step, "layer": layer, "holder": g.address, "rows": len(g.keep),
                "k": int(g.canon.shape[1]), "pick": d.pick,
                "predicted_us": {k: v for k, v in d.predicted_us.items() if math.isfinite(v)},
                "measured_us": measured_s * 1e6, **extra,
            })  # fmt: skip


@dataclass(frozen=True, slots=True)
class LayerCall:
    """One layer call's queries: ``q [n, h, kv_dim]`` at ``layer``, row ``i``'s corpus placed
    at ``offsets[i]`` (int64; ``q`` is rotated back by it for route), scores scaled by ``scale``."""

    layer: int
    q: torch.Tensor
    offsets: torch.Tensor
    scale: float

    def rows(self, keep: torch.Tensor) -> LayerCall:
        """The call over its rows ``keep`` only."""
        return LayerCall(self.layer, self.q[keep], self.offsets[keep], self.scale)


class CorpusBinding(CorpusIndexer):
    """One bound corpus: its plan and per-corpus state (see the module docstring)."""

    engine: Fanout  # the whole engine here; the indexer side needs only its Engine part

    def __init__(
        self,
        engine: Fanout,
        view: CorpusView,
        geometry: Geometry,
        *,
        model: DeepseekV32 | None = None,
        tokens: torch.Tensor | None = None,
        refresh: Callable[[], Awaitable[CorpusView]] | None = None,
        force: str | None = None,
        kv_format: str = "plain",
        stored: Stored | None = None,
        stored_keys: Stored | None = None,
    ) -> None:
        self.engine, self.view, self.geo = engine, view, geometry
        self.stored, self.stored_keys = stored, stored_keys
        self.model, self.tokens, self.refresh = model, tokens, refresh
        self.kv_format = kv_format
        self.force = force  # the monolithic baseline pins "local"
        self.pages = PageCache(view.page_size, engine.fetch_cache_bytes if not force else 0)
        self.keys: dict[int, torch.Tensor] = {}  # replica indexer: layer → [T, D_I]
        self.local: LocalRows | None = None
        self.dead: set[int] = set()  # holders (view indices) that failed a call
        self.failed_at: dict[str, float] = {}  # holder address → when it last failed a call
        # bound from the agent's coordinator snapshot (its time, Unix s) until the coordinator's
        # page table is read for it (table_refresh.py); None: bound from the coordinator or
        # from holders named to it
        self.from_snapshot: float | None = None
        self.speed = HolderSpeed()  # route calls' seconds per row: spreads replicated pages
        self.lock = asyncio.Lock()  # one local re-prefill at a time
        self._failing = asyncio.Lock()

    # -- attention ---------------------------------------------------------------------------------
    async def attend(
        self,
        layer: int,
        q: torch.Tensor,
        canon: torch.Tensor,
        offsets: torch.Tensor | None = None,
        scale: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> PartialOut:
        """``(O [n, h, d_v], LSE [n, h])`` of absorbed queries ``q [n, h, kv_dim]`` over
        canonical corpus positions ``canon [n, k]`` (int64, -1 unused), each row's corpus placed
        at ``offsets [n]`` (default 0; ``q`` is rotated back by it for route). Grouped by holder,
        each group served by the predicate's pick, concurrently, failed over, merged exactly; O
        in ``dtype`` (default ``q``'s). Raises CorpusUnavailable when no replica, refreshed page
        table or local re-prefill can serve a failed holder's rows."""
        if offsets is None:
            offsets = torch.zeros(len(q), dtype=torch.int64)
        scale = self.geo.softmax_scale if scale is None else scale
        call, groups = LayerCall(layer, q, offsets, scale), self.plan(canon)
        results = await asyncio.gather(*(self._group(call, g) for g in groups))
        self.rebalance()
        return merge_groups(q, self.geo.d_v, groups, results, dtype)

    def plan(self, canon: torch.Tensor) -> list[GroupWork]:
        """The rows of canonical positions ``canon [n, k]`` (int64, -1 unused) grouped by the
        holder of each position's page under the current view (the fan-out counted)."""
        groups = holder_groups(self.view, canon)
        self.engine.metrics.fanout.observe(len(groups))
        return groups

    def rebalance(self) -> None:
        """Re-spread replicated pages by the holders' measured speeds (balance.py), when due."""
        if not self.view.shared_pages():
            return
        w = self.speed.due(self.view.holders, self.view.weights)
        if w is not None:
            self.view = self.view.reweighted(w)
            self.engine.metrics.rebalances.inc()
            for address, x in zip(self.view.holders, w, strict=True):
                self.engine.metrics.replica_weight.labels(address).set(x)

    def _shape(self, layer: int, g: GroupWork) -> Group:
        p, geo = self.view.page_size, self.geo
        pages = (g.canon[g.canon >= 0] // p).unique().tolist()
        computed = self.local.computed if self.local is not None else 0
        return group_shape(
            g, geo.heads, geo.kv_dim, geo.d_v,
            missing_pages=len(self.pages.missing(layer, pages)),
            page_bytes=p * geo.kv_dim * geo.dtype.itemsize,
            missing_tokens=max(0, int(g.canon.max()) + 1 - computed),
            local_ok=self._can_recompute(),
        )  # fmt: skip

    async def _group(self, call: LayerCall, g: GroupWork, tries: int | None = None) -> PartialOut:
        engine, shape = self.engine, self._shape(call.layer, g)
        if self.force:  # the monolithic baseline
            decision = Decision(self.force, engine.predicate.costs(shape))
        else:
            decision = engine.decide(shape)
        forced = bool(self.force) or engine.predicate.force != "auto"
        return await self.serve(call, g, decision, forced, tries)

    async def serve(
        self, call: LayerCall, g: GroupWork, decision: Decision, forced: bool,
        tries: int | None = None,
    ) -> PartialOut:  # fmt: skip
        """Group ``g``'s partial of ``call`` (``(O [len(g.keep), h, d_v]`` in the holder's or
        the queries' dtype, ``LSE)``) by ``decision.pick``, recorded with its measured cost
        (``forced``: not the predicate's own pick). A failed holder call fails over
        (:meth:`_recover`, at most ``tries`` times, default once per holder); raises
        CorpusUnavailable as :meth:`attend`."""
        tries = len(self.view.holders) if tries is None else tries
        last = self._last_resort()
        if decision.pick not in ("local", "store") and self._is_dead(g.address) and last:
            # failed before, and no replica took its pages: not called again, served here
            self.engine.metrics.fallbacks.labels(decision.pick, last).inc()
            return await self._execute(call, g, last)
        t0 = time.perf_counter()
        try:
            result = await self._execute(call, g, decision.pick)
        except (grpc.aio.AioRpcError, StatusError) as e:  # gRPC or NVSHMEM: the same path
            self.engine.failed(e)
            return await self._recover(call, g, decision.pick, e, tries)
        took = time.perf_counter() - t0
        if decision.pick in ("route", "fetch"):
            self.engine.warmed(g.address, len(g.keep), decision.pick)
        self.engine.record(call.layer, g, decision, took, forced)
        if decision.pick == "route":
            self.speed.observe(g.address, int((g.canon >= 0).sum()), took)
        return result

    def _is_dead(self, address: str) -> bool:
        return any(i in self.dead for i, a in enumerate(self.view.holders) if a == address)

    def _can_recompute(self) -> bool:
        return self.tokens is not None and self.model is not None

    def _last_resort(self) -> str:
        """How rows no holder serves are served here: "store" (read from the page store),
        "local" (recomputed), or "" (they cannot be)."""
        return "store" if self.stored is not None else "local" if self._can_recompute() else ""

    async def _recover(
        self, call: LayerCall, g: GroupWork, pick: str, e: grpc.aio.AioRpcError | StatusError,
        tries: int,
    ) -> PartialOut:  # fmt: skip
        """A holder failed: its rows go to replicas, else to a re-read page table, else are
        recomputed here; ``tries`` bounds how often one call's rows may fail over."""
        code, detail = failure(e)
        async with self._failing:  # one failover at a time; others re-plan on its result
            held = [i for i, a in enumerate(self.view.holders) if a == g.address]
            if held and not set(held) <= self.dead:
                self.dead.update(held)
                self.failed_at[g.address] = time.monotonic()
                to = await self._fail_over()
                to = (self._last_resort() or "local") if to == "local" else to
                log.warning(
                    "holder %s failed (%s: %s); %s", g.address, code.name, detail, _SAYS[to]
                )
                self.engine.metrics.fallbacks.labels(pick, to).inc()
            elif held and bool(torch.isin(self.view.page_holder, torch.tensor(held)).any()):
                to = self._last_resort() or "local"  # failed over already, no other source
            else:
                to = "replica"  # another call failed it over already: re-plan on the new view
        if to in ("local", "store") or tries <= 0:
            last = self._last_resort()
            if not last:
                raise CorpusUnavailable(
                    f"corpus {self.corpus_id}: holder {g.address} failed ({code.name}: {detail}) "
                    "and its rows have no other source"
                )
            return await self._execute(call, g, last)
        sub = call.rows(g.keep)
        groups = holder_groups(self.view, g.canon)  # a re-plan of a planned call's group
        results = await asyncio.gather(*(self._group(sub, h, tries - 1) for h in groups))
        return merge_groups(sub.q, self.geo.d_v, groups, results)

    async def _fail_over(self) -> str:
        """Re-bind to live replicas ("replica"), or to the page table as re-read ("table"), or
        leave the view and say "local"."""
        try:
            self.view = self.view.failover(self.dead)
            return "replica"
        except CorpusUnavailable:
            if self.refresh is None:
                return "local"
        try:
            view = await self.refresh()
        except Exception as e:  # the coordinator is down too: the rows still have tokens
            log.warning("re-reading corpus %s's page table failed: %s", self.corpus_id, e)
            return "local"
        if view.holders == self.view.holders:
            view = view.reweighted(self.view.weights)  # compared, and kept, spread as now
            if torch.equal(view.page_frame, self.view.page_frame):
                return "local"  # nothing new: the same holders would fail again
        self.view, self.dead = view, set()
        return "table"

    async def _execute(self, call: LayerCall, g: GroupWork, pick: str) -> PartialOut:
        layer, scale, geo = call.layer, call.scale, self.geo
        qg, og = call.q[g.keep], call.offsets[g.keep]
        if pick == "route":
            route = await self.engine.route(g.address)
            q = geo.canonical(qg, og, geo.d_v)
            part = await self.engine.bounded(
                g.address, len(qg), "route",
                lambda timeout: route.attend_rows(
                    self.corpus_id, layer, q, g.rows, scale, timeout=timeout
                ),
            )  # fmt: skip
            return part.o, part.lse
        uniq = g.canon[g.canon >= 0].unique()
        if pick == "fetch":
            rows_of = await self._fetched(layer, g, uniq)
        elif pick == "store":
            rows_of = await self._from_store(layer, uniq)
        else:
            rows_of = await self._local(layer, uniq)
        assert geo.shift is not None or not bool((og != 0).any()), "offsets need geometry.shift"
        shift = geo.shift or _no_shift
        return await self.engine.offload(
            attend_canonical, qg, g.canon, og, rows_of, uniq, shift, scale, geo.d_v
        )

    async def pull(
        self, layer: int, address: str, pages: list[int], timeout: float | None = None
    ) -> torch.Tensor:
        """``latent [len(pages), P, row width]`` of corpus ``pages`` at ``layer``, as holder
        ``address`` keeps them (its dtype and row format); the bytes are counted. Raises the
        holder call's error (DEADLINE_EXCEEDED past ``timeout`` seconds; None: no limit)."""
        lat, _ = await self.engine.client(address).fetch(
            self.corpus_id, pages, layers=[layer], timeout=timeout
        )
        self.engine.metrics.fetched_bytes.inc(lat[0].nbytes)
        return lat[0]

    async def _fetched(self, layer: int, g: GroupWork, uniq: torch.Tensor) -> torch.Tensor:
        pages = (uniq // self.view.page_size).unique().tolist()
        missing = self.pages.missing(layer, pages)
        if missing:
            lat = await self.engine.bounded(
                g.address, len(g.keep), "fetch",
                lambda timeout: self.pull(layer, g.address, missing, timeout),
            )  # fmt: skip
            self.pages.put(layer, missing, lat.to(self.geo.dtype))
        return self.pages.rows(layer, uniq)

    async def _from_store(self, layer: int, uniq: torch.Tensor) -> torch.Tensor:
        assert self.stored is not None
        pages = (uniq // self.view.page_size).unique().tolist()
        missing = self.pages.missing(layer, pages)
        if missing:
            lat = await self.engine.offload(self.stored, layer, missing)
            self.pages.put(layer, missing, lat.to(self.geo.dtype))
        return self.pages.rows(layer, uniq)

    async def _local(self, layer: int, uniq: torch.Tensor) -> torch.Tensor:
        if self.tokens is None or self.model is None:
            raise RuntimeError(
                f"local re-prefill of corpus {self.corpus_id} needs its tokens and the model: "
                "give the worker the page store it was pinned into"
            )
        async with self.lock:
            if self.local is None:
                self.local = LocalRows(self.model, self.tokens, kv_format=self.kv_format)
            done = await self.engine.offload(self.local.ensure, int(uniq.max()) + 1)
        self.engine.metrics.prefilled.inc(done)
        return self.local.rows(layer, uniq)


_SAYS = {
    "replica": "its pages are served by replicas from now on",
    "table": "the corpus's page table was re-read; its rows go where it says now",
    "local": "recomputing its rows here",
    "store": "reading its pages from the page store here",
}


def _no_shift(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError("a corpus at offset 0 needs no rotation")
