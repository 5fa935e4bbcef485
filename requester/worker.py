"""The decode worker: steps many sessions at once against pinned corpora.

One step runs every pending token of every session through the model; per layer:
query → select → plan → fan out → merge (DESIGN.md, "One decode step"). The worker owns the
sessions and the step loop: it writes each step's rows into the sessions' private caches, picks
each row's exact top-k over corpus + private rows, and merges the private partial with the
corpus partial that its :class:`~requester.fanout.CorpusBinding` serves (grouping by holder,
route / fetch / local, fan-out, failover and the LSE merge live there, shared with the SGLang
plugin).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from corpusd.coordinator.client import PageTable
from corpusd.corpus.store import PageStore
from corpusd.kernels import fp8_cache
from corpusd.kernels.merge import merge_partials
from corpusd.model import DeepseekV32, KVCache
from corpusd.model.mla import Projections
from indexer import index_scores
from indexer.modes import select_distributed, select_replica
from requester.config import WorkerConfig
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding, Fanout, Geometry
from requester.metrics import RequesterMetrics
from requester.predicate import Predicate, Profile
from requester.sampling import SamplingParams, sample
from requester.session import Session
from requester.sources import LocalRows
from requester.step import StepRows
from requester.table_refresh import Staged, adopt

log = logging.getLogger("corpusd.requester")
T = TypeVar("T")


class Worker:
    """Hosts sessions and steps them. Create and use it inside one running event loop.

    ``profile`` is the predicate's calibration (default: the built-in constants); the caller
    loads it (``Profile.load``), the worker reads no file of its own accord."""

    def __init__(
        self,
        model: DeepseekV32,
        cfg: WorkerConfig | None = None,
        store: PageStore | None = None,
        profile: Profile | None = None,
        metrics: RequesterMetrics | None = None,
    ) -> None:
        self.model, self.cfg, self.store = model, cfg or WorkerConfig(), store
        self.mcfg = model.cfg
        self.geometry = Geometry.of(model)
        self.metrics = metrics or RequesterMetrics()
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="requester")
        self.trace: list[dict[str, Any]] = []
        c = self.cfg
        self.fanout = Fanout(
            Predicate(profile or Profile(), c.primitive),
            self.metrics,
            transport=c.transport,
            nvshmem_device=c.nvshmem_device,
            rpc_timeout_s=c.rpc_timeout_s,
            holder_deadline_s=c.holder_deadline_s,
            fetch_cache_bytes=c.fetch_cache_bytes,
            offload=self._offload,
            trace=self.trace if c.trace else None,
        )
        self.corpora: dict[str, CorpusBinding] = {}
        # re-read page tables waiting for the next step (table_refresh.py): corpus → (binding, view)
        self.staged: Staged = {}
        self.sessions: dict[str, Session] = {}
        self.steps = 0
        self._stepping = 0  # forward passes in flight: a view is never swapped inside one

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking torch work on the executor so holder calls progress meanwhile."""

        def run() -> T:
            with torch.inference_mode():
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.executor, run)

    async def close(self) -> None:
        await self.fanout.close()
        self.executor.shutdown(wait=False)

    # -- corpora and sessions ----------------------------------------------------------------------
    async def attach(
        self,
        corpus_id: str,
        holders: Sequence[str],
        refresh: Callable[[], Awaitable[CorpusView]] | None = None,
    ) -> CorpusBinding:
        """Bind a corpus pinned on ``holders`` by what they say they hold: its page table, and
        in replica mode its index keys (streamed once); ``refresh`` as for :meth:`attach_table`.
        Raises CorpusUnavailable."""
        clients = {a: self.fanout.client(a) for a in holders}
        return await self._bind(await CorpusView.from_holders(corpus_id, clients), refresh)

    async def attach_table(
        self, table: PageTable, refresh: Callable[[], Awaitable[CorpusView]] | None = None
    ) -> CorpusBinding:
        """Bind a corpus by the coordinator's page table (replicas and liveness included);
        ``refresh`` re-reads it when a failover finds no live replica."""
        return await self._bind(CorpusView.from_page_table(table), refresh)

    def adopt_views(self) -> int:
        """Give bindings the views their re-read page tables staged (``staged``), keeping the
        holders each marked failed; returns how many. Called between steps only."""
        assert not self._stepping, "a view is swapped between steps, never inside one"
        return adopt(self.corpora, self.staged)

    async def _bind(
        self, view: CorpusView, refresh: Callable[[], Awaitable[CorpusView]] | None = None
    ) -> CorpusBinding:
        tokens, kv_format, stored, stored_keys = None, "plain", None, None
        if self.store is not None and view.corpus_id in self.store.ids():
            tokens = self.store.read_tokens(view.corpus_id).to(torch.int64)
            kv_format = self.store.manifest(view.corpus_id).kv_format
            if kv_format == "plain":  # a failed holder's pages, read where it loaded them from
                stored = functools.partial(_stored_latent, self.store, view.corpus_id)
                stored_keys = functools.partial(_stored_keys, self.store, view.corpus_id)
        b = await self.fanout.bind(
            view, self.geometry, model=self.model, tokens=tokens, kv_format=kv_format,
            refresh=refresh, stored=stored, stored_keys=stored_keys,
        )  # fmt: skip
        if self.cfg.indexer == "replica":
            for layer in range(self.mcfg.num_hidden_layers):
                await b.index_keys(layer)
        self.corpora[view.corpus_id] = b
        return b

    def detach(self, corpus_id: str) -> list[str]:
        """Drop a bound corpus — its page table, index keys, fetched pages and re-prefilled rows
        go with its binding — and close the sessions on it; returns their ids. A corpus not
        bound here is no error (returns [])."""
        b = self.corpora.pop(corpus_id, None)
        self.staged.pop(corpus_id, None)
        if b is None:
            return []
        gone = [sid for sid, s in self.sessions.items() if s.corpus.corpus_id == corpus_id]
        for sid in gone:
            self.close_session(sid)
        return gone

    def attach_monolithic(self, corpus_id: str) -> CorpusBinding:
        """The baseline: the whole corpus cache read from the page store into this process and
        attended locally (no holders). Needs ``store``."""
        assert self.store is not None, "the monolithic baseline reads the page store"
        m = self.store.manifest(corpus_id)
        pages = list(range(m.n_pages))
        lat, keys = zip(
            *(self.store.read_pages(corpus_id, li, pages) for li in range(m.n_layers)), strict=True
        )
        t = m.token_count
        tokens = self.store.read_tokens(corpus_id).to(torch.int64)
        local = LocalRows(self.model, tokens)
        if m.kv_format != "plain":  # fp8 rows: attend what the holders attend
            lat = tuple(fp8_cache.dequantize(x.reshape(-1, x.shape[-1])) for x in lat)
        local.load(
            [x.reshape(-1, x.shape[-1])[:t].to(self.geometry.dtype) for x in lat],
            [x.reshape(-1, x.shape[-1])[:t].to(self.geometry.dtype) for x in keys],
        )
        view = CorpusView(
            corpus_id,
            t,
            m.page_size,
            ("local",),
            torch.zeros(m.n_pages, dtype=torch.int64),
            torch.arange(m.n_pages),
            ((),) * m.n_pages,
        )
        b = CorpusBinding(
            self.fanout, view, self.geometry, model=self.model, tokens=tokens, force="local"
        )
        b.local = local
        b.keys = {li: k[:t] for li, k in enumerate(local.cache.index_keys)}
        self.corpora[corpus_id] = b
        return b

    def open(
        self,
        corpus_id: str,
        prompt: Sequence[int],
        prefix: Sequence[int] = (),
        params: SamplingParams | None = None,
        keep_logits: bool = False,
    ) -> Session:
        """Fork an attached corpus. ``prefix`` tokens go before the corpus (which then sits at
        offset ``len(prefix)``), ``prompt`` after it. Raises KeyError (corpus not attached) or
        ValueError (a token outside the vocabulary, an empty prompt)."""
        if corpus_id not in self.corpora:
            raise KeyError(f"corpus {corpus_id!r} is not attached to this worker")
        vocab = self.mcfg.vocab_size
        toks = [*prefix, *prompt]
        if not prompt:
            raise ValueError("a session needs at least one prompt token")
        bad = [t for t in toks if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"tokens {bad[:4]} are outside the vocabulary [0, {vocab})")
        params = params or SamplingParams()
        s = Session(
            id=uuid.uuid4().hex[:16],
            corpus=self.corpora[corpus_id].view,
            offset=len(prefix),
            cache=KVCache(self.mcfg, max(64, len(toks) + 16), self.geometry.dtype),
            pending=toks,
            params=params,
        )
        s.gen.manual_seed(params.seed)
        s.logits = [] if keep_logits else None
        self.sessions[s.id] = s
        self.metrics.sessions.set(len(self.sessions))
        return s

    def close_session(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise KeyError(f"no session {session_id!r}")
        self.metrics.sessions.set(len(self.sessions))

    # -- generation --------------------------------------------------------------------------------
    async def stream(self, sessions: Sequence[Session]) -> AsyncIterator[list[tuple[Session, int]]]:
        """Step ``sessions`` together until each stops; yields each step's new tokens."""
        active = [s for s in sessions if not s.done]
        while active:
            yield await self.step(active)
            active = [s for s in active if not s.done]

    async def step(self, sessions: Sequence[Session]) -> list[tuple[Session, int]]:
        """Feed every session's pending tokens and sample one token each; a session whose
        token is a stop token or reaches ``max_tokens`` gets its ``finish_reason``."""
        logits = await self.forward([(s, s.pending) for s in sessions])
        events = []
        for s, lg in zip(sessions, logits, strict=True):
            if s.logits is not None:
                s.logits.append(lg)
            tok = sample(lg, s.params, s.gen)
            s.generated.append(tok)
            s.pending = [tok]
            if tok in s.params.stop_token_ids:
                s.finish_reason = "stop"
            elif len(s.generated) >= s.params.max_tokens:
                s.finish_reason = "length"
            events.append((s, tok))
        return events

    async def generate(self, sessions: Sequence[Session]) -> None:
        async for _ in self.stream(sessions):
            pass

    # -- one step ----------------------------------------------------------------------------------
    async def forward(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> torch.Tensor:
        """Run each session's new tokens (appending to its private cache); float32 logits
        ``[len(batch), vocab]`` of each session's last new token."""
        if not self._stepping and self.staged:
            self.adopt_views()  # between steps: every layer of this one plans on one view
        self._stepping += 1
        try:
            return await self._forward(batch)
        finally:
            self._stepping -= 1

    async def _forward(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> torch.Tensor:
        t0 = time.perf_counter()
        self.fanout.step = self.steps
        rows = StepRows.of(batch)
        m = self.model
        with torch.inference_mode():
            cos, sin = m.rotary.cos_sin(rows.pos)
            x = m.model.embed_tokens(torch.tensor([t for _, new in batch for t in new]))
        for li, layer in enumerate(m.layers):
            with torch.inference_mode():
                proj = layer.project(x, cos, sin)
                for i, s in enumerate(rows.sessions):
                    sel = rows.sess == i
                    s.cache.latent[li][rows.priv[sel]] = proj.cache_row[sel]
                    s.cache.index_keys[li][rows.priv[sel]] = proj.index_key[sel]
            o = await self._attend(li, proj, rows)
            with torch.inference_mode():
                x = layer.finish(x, o)
        for s, end in zip(rows.sessions, rows.ends, strict=True):
            s.cache.length = end
        last = torch.tensor([int((rows.sess == i).nonzero().max()) for i in range(len(batch))])
        with torch.inference_mode():
            logits = m.logits(x[last])
        self.steps += 1
        self.metrics.rows.inc(len(rows.pos))
        self.metrics.step.observe(time.perf_counter() - t0)
        return logits

    async def _attend(self, layer: int, proj: Projections, rows: StepRows) -> torch.Tensor:
        """Merged latent attention output ``[n, h, d_v]`` of every row of the step."""
        by_corpus: dict[str, list[int]] = {}
        for r, i in enumerate(rows.sess.tolist()):
            by_corpus.setdefault(rows.sessions[i].corpus.corpus_id, []).append(r)
        idx = [torch.tensor(v) for v in by_corpus.values()]
        outs = await asyncio.gather(
            *(
                self._attend_corpus(self.corpora[cid], layer, proj, rows, ridx)
                for cid, ridx in zip(by_corpus, idx, strict=True)
            )
        )
        n, h = proj.q.shape[:2]
        o = proj.q.new_empty(n, h, self.mcfg.kv_lora_rank)
        for ridx, out in zip(idx, outs, strict=True):
            o[ridx] = out
        return o

    async def _attend_corpus(
        self, b: CorpusBinding, layer: int, proj: Projections, rows: StepRows, ridx: torch.Tensor
    ) -> torch.Tensor:
        q, offset = proj.q[ridx], rows.offset[ridx]
        t = b.view.token_count
        sel = await self._select(b, layer, proj, rows, ridx)  # [m, k] logical
        in_corpus = (sel >= offset[:, None]) & (sel < offset[:, None] + t)
        canon = torch.where(in_corpus, sel - offset[:, None], -1)
        private = torch.where((sel >= 0) & ~in_corpus, sel, -1)
        mine, theirs = await asyncio.gather(
            self._offload(rows.private_partial, q, ridx, private, layer, self.mcfg),
            b.attend(layer, q, canon, offset),
        )
        merged, _ = merge_partials([mine, theirs])
        return merged

    # -- for external engines ----------------------------------------------------------------------
    async def attend(
        self,
        corpus_id: str,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor | None = None,
        index_q: torch.Tensor | None = None,
        index_w: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(O [n, h, d_v], LSE [n, h])`` of absorbed queries ``q [n, h, kv_dim]`` over an
        attached corpus at canonical positions (its first token at 0; rope ``q`` accordingly).
        Keys: ``positions [n, k]`` (``-1`` unused), or the top ``index_topk`` of the whole corpus
        by ``index_q [n, H_I, D_I]`` and ``index_w [n, H_I]``. The caller merges its own
        partial with this one by LSE. Raises KeyError (corpus not attached)."""
        if not self._stepping and self.staged:
            self.adopt_views()
        b = self.corpora[corpus_id]
        if positions is None:
            assert index_q is not None and index_w is not None, "positions or index_q/index_w"
            positions = await b.topk(layer, index_q, index_w)
        return await b.attend(layer, q.to(self.geometry.dtype), positions, scale=scale)

    # -- select ------------------------------------------------------------------------------------
    async def _select(
        self, b: CorpusBinding, layer: int, proj: Projections, rows: StepRows, ridx: torch.Tensor
    ) -> torch.Tensor:
        """Exact top-k (logical positions ``[m, index_topk]``) over corpus + private rows."""
        c = self.mcfg
        k, scale = c.index_topk, c.index_head_dim**-0.5
        offset, pos, sess = rows.offset[ridx], rows.pos[ridx], rows.sess[ridx]
        iq_c = self.geometry.canonical(proj.index_q[ridx], offset, 0)
        iw = proj.index_w[ridx]
        members = [(i, sess == i) for i in sess.unique().tolist()]
        out = torch.full((len(ridx), k), -1, dtype=torch.int64)

        if b.keys:  # replica
            keys = await b.index_keys(layer)

            def replica() -> torch.Tensor:
                corpus = index_scores(iq_c, iw, keys, scale, c.index_arith)
                for i, m in members:
                    ps = rows.private_scores(layer, proj, ridx[m], i, self.mcfg)
                    out[m] = select_replica(ps, corpus[m], rows.sessions[i].offset, pos[m], k)
                return out

            return await self._offload(replica)

        limit = (pos - offset + 1).clamp(0, b.view.token_count)
        privs = self._offload(
            lambda: [rows.private_scores(layer, proj, ridx[m], i, c) for i, m in members]
        )
        parts, private_scores = await asyncio.gather(b.holder_topk(layer, iq_c, iw, limit), privs)
        for (i, m), ps in zip(members, private_scores, strict=True):
            s = rows.sessions[i]
            logical = s.logical(torch.arange(rows.ends[i]))
            cands = [(p_[m], sc[m]) for p_, sc in parts]
            out[m] = select_distributed(ps, logical, cands, s.offset, pos[m], k)
        return out


def _stored_latent(store: PageStore, corpus_id: str, layer: int, pages: list[int]) -> torch.Tensor:
    """Latent rows ``[len(pages), P, kv_dim]`` of a plain corpus, as its page store has them."""
    return store.read_pages(corpus_id, layer, pages)[0]


def _stored_keys(store: PageStore, corpus_id: str, layer: int, pages: list[int]) -> torch.Tensor:
    """Index keys ``[len(pages), P, index_dim]`` of a plain corpus, as its page store has them."""
    return store.read_pages(corpus_id, layer, pages)[1]
