"""The decode worker: steps many sessions at once against pinned corpora.

One step runs every pending token of every session through the model; per layer:
query → select → plan → fan out → merge (DESIGN.md, "One decode step"). Selected corpus rows are
grouped by holder; the predicate picks route, fetch or local per group; every route of a layer
goes out concurrently, one request per holder carrying the rows of all sessions bound there,
while the sessions' own partials run beside them; the partials merge exactly by LSE.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from corpusd import env
from corpusd.coordinator.client import PageTable
from corpusd.corpus.store import PageStore
from corpusd.model import DeepseekV32, KVCache
from corpusd.model.mla import Projections
from corpusd.model.partial import merge_partials, partial_attention
from corpusd.model.rope import shift_band
from corpusd.rpc import StatusError
from corpusd.transport import nvshmem_ring
from indexer import index_scores
from indexer.modes import select_distributed, select_replica
from indexer.select import merge_topk, select_topk
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.holder_client import HolderClient
from requester.metrics import RequesterMetrics
from requester.predicate import PRIMITIVES, Decision, Group, Predicate, Profile
from requester.routes import TRANSPORTS, Route, connect, requester_id
from requester.sampling import SamplingParams, sample
from requester.session import Session
from requester.sources import LocalRows, PageCache, attend_canonical

log = logging.getLogger("corpusd.requester")
T = TypeVar("T")
INDEXER_MODES = ("replica", "distributed")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    indexer: str = field(
        default="replica",
        metadata={
            "help": "corpus index keys held here (replica) or top-k on holders",
            "choices": INDEXER_MODES,
        },
    )
    primitive: str = field(
        default="auto",
        metadata={
            "help": "force route/fetch/local, or let the predicate pick",
            "choices": ("auto", *PRIMITIVES),
        },
    )
    fetch_cache_bytes: int = field(default=1 << 30, metadata={"help": "fetched-page cache"})
    rpc_timeout_s: float = field(default=60.0, metadata={"help": "per holder call"})
    profile: str = field(default="", metadata={"help": "calibration profile JSON"})
    transport: str = field(
        default="auto",
        metadata={
            "help": "routes to a holder: nvshmem when both ends share an NVSHMEM job (auto), "
            "or force one",
            "choices": TRANSPORTS,
        },
    )
    nvshmem_device: int = field(
        default=0, metadata={"help": "the CUDA device this worker's NVSHMEM transport runs on"}
    )
    trace: bool = field(default=False, metadata={"help": "keep every decision in .trace"})

    def __post_init__(self) -> None:
        if self.indexer not in INDEXER_MODES:
            raise ValueError(f"indexer must be one of {INDEXER_MODES}, got {self.indexer!r}")
        if self.primitive not in ("auto", *PRIMITIVES):
            raise ValueError(f"primitive must be auto or one of {PRIMITIVES}")
        if self.fetch_cache_bytes < 0 or not self.rpc_timeout_s > 0:
            raise ValueError("fetch_cache_bytes must be >= 0 and rpc_timeout_s > 0")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "nvshmem" and not nvshmem_ring.available():
            raise ValueError("transport nvshmem needs a CUDA GPU and nvshmem4py (.gpu-deps)")


def load_profile(path: str) -> Profile:
    """The given profile, else ``$CORPUSD_HOME/profile.json`` when present, else defaults."""
    p = Path(path) if path else env.home() / "profile.json"
    if path or p.is_file():
        return Profile.load(p)
    return Profile()


@dataclass
class CorpusState:
    """What this worker keeps of one corpus."""

    view: CorpusView
    pages: PageCache
    keys: list[torch.Tensor] | None = None  # replica indexer: [T, D_I] per layer
    tokens: torch.Tensor | None = None  # for local re-prefill (from the page store)
    local: LocalRows | None = None
    force: str | None = None  # the monolithic baseline pins "local"
    dead: set[int] = field(default_factory=set)  # holders (view indices) that failed a call
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class StepRows:
    """The query rows of one step: row ``r`` is a token of ``sessions[sess[r]]`` at private
    index ``priv[r]`` and logical position ``pos[r]``; ``ends[i]`` is session i's private length
    once the step's rows are written."""

    sessions: list[Session]
    sess: torch.Tensor
    priv: torch.Tensor
    pos: torch.Tensor
    offset: torch.Tensor
    ends: list[int]


@dataclass(frozen=True)
class GroupWork:
    """The rows of one layer step bound for one holder: ``keep`` are row numbers within the
    corpus's rows; ``prow`` / ``canon`` ``[len(keep), k_h]`` pool rows / canonical positions."""

    holder: int
    keep: torch.Tensor
    prow: torch.Tensor
    canon: torch.Tensor


def _failure(e: grpc.aio.AioRpcError | StatusError) -> tuple[grpc.StatusCode, str]:
    """The status and message of a failed holder call, whichever transport it went over."""
    if isinstance(e, StatusError):
        return e.code, e.detail
    return e.code(), e.details() or ""


def compact(mask: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rows of ``mask [m, k]`` with any True, and each value's True entries moved to the front
    (``-1`` after), trimmed to the widest row."""
    keep = mask.any(dim=1).nonzero().squeeze(1)
    mk = mask[keep]
    order = (~mk).to(torch.int8).argsort(dim=1, stable=True)
    mk = mk.gather(1, order)
    width = int(mk.sum(dim=1).max()) if keep.numel() else 0
    out = [torch.where(mk, v[keep].gather(1, order), -1)[:, :width] for v in values]
    return keep, out


def holder_groups(view: CorpusView, canon: torch.Tensor) -> list[GroupWork]:
    """The rows of canonical positions ``canon [n, k]`` (-1 unused) grouped by the holder of
    each position's page under ``view``."""
    holder, prow = view.pool_rows(canon)
    groups = []
    for hi in holder.unique().tolist():
        if hi >= 0:
            keep, (pr, cn) = compact(holder == hi, prow, canon)
            groups.append(GroupWork(hi, keep, pr, cn))
    return groups


def merge_groups(
    q: torch.Tensor,
    d_v: int,
    groups: Sequence[GroupWork],
    results: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of each group's ``(O, LSE)`` over its rows: ``(O [n, h, d_v]`` in ``q``'s
    dtype and device, ``LSE [n, h])``; rows no group served are empty (O 0, LSE -inf)."""
    n, h = q.shape[:2]
    empty = torch.full((n, h), float("-inf"), device=q.device)
    parts = [(q.new_zeros(n, h, d_v), empty)]
    for g, (o_g, lse_g) in zip(groups, results, strict=True):
        o, lse = q.new_zeros(n, h, d_v), empty.clone()
        keep = g.keep.to(q.device)
        o[keep], lse[keep] = o_g.to(q), lse_g.to(lse)
        parts.append((o, lse))
    return merge_partials(parts)


class Worker:
    """Hosts sessions and steps them. Create and use it inside one running event loop."""

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
        self.dtype = next(model.parameters()).dtype
        self.predicate = Predicate(profile or load_profile(self.cfg.profile), self.cfg.primitive)
        self.metrics = metrics or RequesterMetrics()
        self.clients: dict[str, HolderClient] = {}
        self.routes: dict[str, Route] = {}  # holder address → how its routes travel
        self._connecting: dict[str, asyncio.Lock] = {}
        self.corpora: dict[str, CorpusState] = {}
        self.sessions: dict[str, Session] = {}
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="requester")
        self.trace: list[dict[str, Any]] = []
        self._step = 0

    async def _off(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking torch work on the executor so holder calls progress meanwhile."""

        def run() -> T:
            with torch.inference_mode():
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.executor, run)

    def client(self, address: str) -> HolderClient:
        if address not in self.clients:
            self.clients[address] = HolderClient(address)
        return self.clients[address]

    async def route(self, address: str) -> Route:
        """The holder's route transport (``cfg.transport``; chosen once, logged and exported as
        ``corpusd_requester_transport_info{holder,transport}``). Raises ValueError when a forced
        transport cannot work for it."""
        if address in self.routes:
            return self.routes[address]
        async with self._connecting.setdefault(address, asyncio.Lock()):
            if address not in self.routes:
                r = await connect(
                    address,
                    self.client(address),
                    self.cfg.transport,
                    self.cfg.nvshmem_device,
                    f"{requester_id()}:{id(self):x}",
                )
                self.routes[address] = r
                for name in TRANSPORTS[1:]:
                    self.metrics.transport.labels(address, name).set(int(name == r.name))
        return self.routes[address]

    async def close(self) -> None:
        for r in self.routes.values():
            await r.close()
        for c in self.clients.values():
            await c.close()
        self.executor.shutdown(wait=False)

    # -- corpora and sessions ----------------------------------------------------------------------
    async def attach(self, corpus_id: str, holders: Sequence[str]) -> CorpusState:
        """Bind a corpus pinned on ``holders``: its page table, and in replica mode its index
        keys (streamed once). Raises CorpusUnavailable."""
        view = await CorpusView.from_holders(corpus_id, {a: self.client(a) for a in holders})
        return await self._attach_view(view)

    async def attach_table(self, table: PageTable) -> CorpusState:
        """Bind a corpus by the coordinator's page table (replicas and liveness included)."""
        return await self._attach_view(CorpusView.from_page_table(table))

    async def _attach_view(self, view: CorpusView) -> CorpusState:
        corpus_id = view.corpus_id
        for address in view.holders:  # transports are chosen (NVSHMEM joined) before decoding
            await self.route(address)
        st = CorpusState(view, PageCache(view.page_size, self.cfg.fetch_cache_bytes))
        if self.store is not None and corpus_id in self.store.ids():
            st.tokens = self.store.read_tokens(corpus_id).to(torch.int64)
        if self.cfg.indexer == "replica":
            st.keys = [
                await self._replica_keys(view, li) for li in range(self.mcfg.num_hidden_layers)
            ]
        self.corpora[corpus_id] = st
        return st

    async def _replica_keys(self, view: CorpusView, layer: int) -> torch.Tensor:
        p = view.page_size
        keys = torch.empty(view.n_pages * p, self.mcfg.index_head_dim, dtype=self.dtype)
        got: set[int] = set()
        for addr in view.holders:
            for page, k in (await self.client(addr).index_keys(view.corpus_id, layer)).items():
                keys[page * p : (page + 1) * p] = k
                got.add(page)
        assert len(got) == view.n_pages, f"index keys of {view.n_pages - len(got)} pages missing"
        return keys[: view.token_count]

    def attach_monolithic(self, corpus_id: str) -> CorpusState:
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
        local.load(
            [x.reshape(-1, x.shape[-1])[:t].to(self.dtype) for x in lat],
            [x.reshape(-1, x.shape[-1])[:t].to(self.dtype) for x in keys],
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
        keys_t = [k[:t] for k in local.cache.index_keys]
        st = CorpusState(
            view, PageCache(m.page_size, 0), keys=keys_t, tokens=tokens, local=local, force="local"
        )
        self.corpora[corpus_id] = st
        return st

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
            cache=KVCache(self.mcfg, max(64, len(toks) + 16), self.dtype),
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
        t0 = time.perf_counter()
        rows = self._rows(batch)
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
        self._step += 1
        self.metrics.rows.inc(len(rows.pos))
        self.metrics.step.observe(time.perf_counter() - t0)
        return logits

    def _rows(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> StepRows:
        sessions = [s for s, _ in batch]
        assert len({s.id for s in sessions}) == len(sessions), "a session appears twice in a step"
        sess: list[int] = []
        priv: list[int] = []
        ends: list[int] = []
        for i, (s, new) in enumerate(batch):
            assert new, f"session {s.id} has no tokens to feed"
            s.cache.reserve(len(new))
            sess += [i] * len(new)
            priv += range(s.cache.length, s.cache.length + len(new))
            ends.append(s.cache.length + len(new))
        sess_t, priv_t = torch.tensor(sess), torch.tensor(priv)
        pos = torch.cat([s.logical(priv_t[sess_t == i]) for i, s in enumerate(sessions)])
        offset = torch.tensor([s.offset for s in sessions])[sess_t]
        return StepRows(sessions, sess_t, priv_t, pos, offset, ends)

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
        self, st: CorpusState, layer: int, proj: Projections, rows: StepRows, ridx: torch.Tensor
    ) -> torch.Tensor:
        q, off = proj.q[ridx], rows.offset[ridx]
        t = st.view.token_count
        sel = await self._select(st, layer, proj, rows, ridx)  # [m, k] logical
        in_corpus = (sel >= off[:, None]) & (sel < off[:, None] + t)
        canon = torch.where(in_corpus, sel - off[:, None], -1)
        private = torch.where((sel >= 0) & ~in_corpus, sel, -1)
        mine, theirs = await asyncio.gather(
            self._off(self._private_partial, q, rows, ridx, private, layer),
            self._route_all(st, layer, q, off, canon, self.mcfg.softmax_scale),
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
        st = self.corpora[corpus_id]
        if positions is None:
            assert index_q is not None and index_w is not None, "positions or index_q/index_w"
            positions = await self._corpus_topk(st, layer, index_q, index_w)
        off = torch.zeros(len(q), dtype=torch.int64)
        scale = self.mcfg.softmax_scale if scale is None else scale
        return await self._route_all(st, layer, q.to(self.dtype), off, positions, scale)

    async def _corpus_topk(
        self, st: CorpusState, layer: int, iq: torch.Tensor, iw: torch.Tensor
    ) -> torch.Tensor:
        k, scale = self.mcfg.index_topk, self.mcfg.index_head_dim**-0.5
        iq, iw = iq.to(self.dtype), iw.to(self.dtype)
        if st.keys is not None:
            keys = st.keys[layer]
            arith = self.mcfg.index_arith
            return await self._off(lambda: select_topk(index_scores(iq, iw, keys, scale, arith), k))
        limit = torch.full((len(iq),), st.view.token_count, dtype=torch.int64)
        parts = await asyncio.gather(
            *(
                self.client(a).index_topk(
                    st.view.corpus_id, layer, iq, iw, limit, k, self.mcfg.index_arith
                )
                for i, a in enumerate(st.view.holders)
                if i not in st.dead
            )
        )
        positions = torch.cat([p for p, _ in parts], 1)
        return merge_topk(positions, torch.cat([s for _, s in parts], 1), k)

    # -- select ------------------------------------------------------------------------------------
    def _canonical(self, x: torch.Tensor, off: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate the rope band at ``start`` back by each row's corpus offset (no-op at 0)."""
        if not bool((off != 0).any()):
            return x
        cos, sin = self.model.rotary.shift(-off)
        return shift_band(x, start, self.mcfg.qk_rope_head_dim, cos, sin)

    def _private_scores(
        self,
        layer: int,
        proj: Projections,
        rows: StepRows,
        ridx: torch.Tensor,
        i: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        s = rows.sessions[i]
        keys = s.cache.index_keys[layer][: rows.ends[i]]
        r = ridx[mask]
        c = self.mcfg
        return index_scores(
            proj.index_q[r], proj.index_w[r], keys, c.index_head_dim**-0.5, c.index_arith
        )

    async def _select(
        self, st: CorpusState, layer: int, proj: Projections, rows: StepRows, ridx: torch.Tensor
    ) -> torch.Tensor:
        """Exact top-k (logical positions ``[m, index_topk]``) over corpus + private rows."""
        c = self.mcfg
        k, scale = c.index_topk, c.index_head_dim**-0.5
        off, pos, sess = rows.offset[ridx], rows.pos[ridx], rows.sess[ridx]
        iq_c = self._canonical(proj.index_q[ridx], off, 0)
        iw = proj.index_w[ridx]
        members = [(i, sess == i) for i in sess.unique().tolist()]

        if st.keys is not None:  # replica

            def replica() -> torch.Tensor:
                assert st.keys is not None
                corpus = index_scores(iq_c, iw, st.keys[layer], scale, c.index_arith)
                out = torch.full((len(ridx), k), -1, dtype=torch.int64)
                for i, m in members:
                    ps = self._private_scores(layer, proj, rows, ridx, i, m)
                    out[m] = select_replica(ps, corpus[m], rows.sessions[i].offset, pos[m], k)
                return out

            return await self._off(replica)

        limit = (pos - off + 1).clamp(0, st.view.token_count)
        calls = [
            self.client(a).index_topk(st.view.corpus_id, layer, iq_c, iw, limit, k, c.index_arith)
            for i, a in enumerate(st.view.holders)
            if i not in st.dead
        ]
        privs = self._off(
            lambda: [self._private_scores(layer, proj, rows, ridx, i, m) for i, m in members]
        )
        parts, private_scores = await asyncio.gather(asyncio.gather(*calls), privs)
        out = torch.full((len(ridx), k), -1, dtype=torch.int64)
        for (i, m), ps in zip(members, private_scores, strict=True):
            s = rows.sessions[i]
            logical = s.logical(torch.arange(rows.ends[i]))
            cands = [(p_[m], sc[m]) for p_, sc in parts]
            out[m] = select_distributed(ps, logical, cands, s.offset, pos[m], k)
        return out

    # -- partials ----------------------------------------------------------------------------------
    def _private_partial(
        self,
        q: torch.Tensor,
        rows: StepRows,
        ridx: torch.Tensor,
        private: torch.Tensor,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, h = q.shape[:2]
        o = q.new_zeros(n, h, self.mcfg.kv_lora_rank)
        lse = torch.full((n, h), float("-inf"))
        sess = rows.sess[ridx]
        for i in sess.unique().tolist():
            m = sess == i
            s = rows.sessions[i]
            pidx = torch.where(private[m] >= 0, s.private_index(private[m]), -1)
            o[m], lse[m] = partial_attention(
                q[m], s.cache.latent[layer], pidx, self.mcfg.softmax_scale, self.mcfg.kv_lora_rank
            )
        return o, lse

    def _group_shape(self, st: CorpusState, layer: int, g: GroupWork) -> Group:
        valid = g.canon >= 0
        p = st.view.page_size
        pages = (g.canon[valid] // p).unique().tolist()
        end = int(g.canon.max()) + 1
        computed = st.local.computed if st.local is not None else 0
        return Group(
            n=len(g.keep),
            k=g.canon.shape[1],
            h=self.mcfg.num_attention_heads,
            rows=int(valid.sum()),
            missing_pages=len(st.pages.missing(layer, pages)),
            page_bytes=p * self.mcfg.kv_dim * self.dtype.itemsize,
            missing_tokens=max(0, end - computed),
            local_ok=st.tokens is not None,
            kv_dim=self.mcfg.kv_dim,
            d_v=self.mcfg.kv_lora_rank,
        )

    async def _group(
        self,
        st: CorpusState,
        layer: int,
        q: torch.Tensor,
        off: torch.Tensor,
        g: GroupWork,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.mcfg.softmax_scale if scale is None else scale
        shape = self._group_shape(st, layer, g)
        decision = (
            Decision(st.force, self.predicate.costs(shape))
            if st.force
            else self.predicate.decide(shape)
        )
        t0 = time.perf_counter()
        try:
            result = await self._execute(st, layer, q, off, g, decision.pick, scale)
        except (grpc.aio.AioRpcError, StatusError) as e:  # gRPC or NVSHMEM: the same path
            code, _ = _failure(e)
            self.metrics.errors.labels(code.name).inc()
            return await self._recover(st, layer, q, off, g, scale, decision.pick, e)
        self._record(layer, st, g, decision, time.perf_counter() - t0)
        return result

    async def _recover(
        self,
        st: CorpusState,
        layer: int,
        q: torch.Tensor,
        off: torch.Tensor,
        g: GroupWork,
        scale: float,
        pick: str,
        e: grpc.aio.AioRpcError | StatusError,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A holder failed: serve its rows from replicas on the other holders (and bind the
        corpus to those from now on); pages with no other replica are recomputed here from the
        tokens. A failed holder loses no data, so the result is the same."""
        failed = st.view.holders[g.holder]
        st.dead.add(g.holder)
        try:
            st.view = st.view.failover(st.dead)
            to = "replica"
        except CorpusUnavailable:
            if st.tokens is None:
                raise
            to = "local"
        code, detail = _failure(e)
        log.warning(
            "holder %s failed (%s: %s); %s",
            failed,
            code.name,
            detail,
            "its pages are served by replicas from now on"
            if to == "replica"
            else "recomputing its rows here",
        )
        self.metrics.fallbacks.labels(pick, to).inc()
        if to == "local":
            return await self._execute(st, layer, q, off, g, "local", scale)
        return await self._route_all(st, layer, q[g.keep], off[g.keep], g.canon, scale)

    async def _route_all(
        self,
        st: CorpusState,
        layer: int,
        q: torch.Tensor,
        off: torch.Tensor,
        canon: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(O, LSE)`` of rows ``q`` over canonical corpus positions ``canon [n, k]``: grouped
        by holder under the current view, each group served (predicate's pick), merged."""
        groups = holder_groups(st.view, canon)
        self.metrics.fanout.observe(len(groups))
        results = await asyncio.gather(*(self._group(st, layer, q, off, g, scale) for g in groups))
        return merge_groups(q, self.mcfg.kv_lora_rank, groups, results)

    async def _execute(
        self,
        st: CorpusState,
        layer: int,
        q: torch.Tensor,
        off: torch.Tensor,
        g: GroupWork,
        pick: str,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qg, og = q[g.keep], off[g.keep]
        if pick == "route":
            part = await (await self.route(st.view.holders[g.holder])).attend(
                st.view.corpus_id,
                layer,
                self._canonical(qg, og, self.mcfg.kv_lora_rank),
                g.prow,
                scale,
                timeout=self.cfg.rpc_timeout_s,
            )
            return part.o, part.lse
        uniq = g.canon[g.canon >= 0].unique()
        if pick == "fetch":
            rows_of = await self._fetched(st, layer, g, uniq)
        else:
            rows_of = await self._local(st, layer, uniq)
        return await self._off(
            attend_canonical,
            qg,
            g.canon,
            og,
            rows_of,
            uniq,
            self.model.rotary.shift,
            scale,
            self.mcfg.kv_lora_rank,
        )

    async def _fetched(
        self, st: CorpusState, layer: int, g: GroupWork, uniq: torch.Tensor
    ) -> torch.Tensor:
        pages = (uniq // st.view.page_size).unique().tolist()
        missing = st.pages.missing(layer, pages)
        if missing:
            lat, _ = await self.client(st.view.holders[g.holder]).fetch(
                st.view.corpus_id, missing, layers=[layer]
            )
            st.pages.put(layer, missing, lat[0].to(self.dtype))
            self.metrics.fetched_bytes.inc(lat[0].nbytes)
        return st.pages.rows(layer, uniq)

    async def _local(self, st: CorpusState, layer: int, uniq: torch.Tensor) -> torch.Tensor:
        if st.tokens is None:
            raise RuntimeError(
                f"local re-prefill of corpus {st.view.corpus_id} needs its tokens: give the "
                "worker the page store it was pinned into"
            )
        async with st.lock:
            if st.local is None:
                st.local = LocalRows(self.model, st.tokens)
            done = await self._off(st.local.ensure, int(uniq.max()) + 1)
        self.metrics.prefilled.inc(done)
        return st.local.rows(layer, uniq)

    def _record(
        self, layer: int, st: CorpusState, g: GroupWork, d: Decision, measured_s: float
    ) -> None:
        m = self.metrics
        predicted_s = d.predicted_us[d.pick] / 1e6
        m.decisions.labels(
            d.pick, "yes" if (st.force or self.predicate.force != "auto") else "no"
        ).inc()
        m.predicted.labels(d.pick).observe(predicted_s)
        m.measured.labels(d.pick).observe(measured_s)
        if predicted_s > 0:
            m.misprediction.labels(d.pick).set(measured_s / predicted_s)
        log.debug(
            "step %d layer %d holder %s rows %d: %s predicted %.0f µs (%s) measured %.0f µs",
            self._step,
            layer,
            st.view.holders[g.holder],
            len(g.keep),
            d.pick,
            d.predicted_us[d.pick],
            ", ".join(f"{k} {v:.0f}" for k, v in d.predicted_us.items()),
            measured_s * 1e6,
        )
        if self.cfg.trace:
            self.trace.append(
                {
                    "step": self._step,
                    "layer": layer,
                    "holder": g.holder,
                    "rows": len(g.keep),
                    "k": int(g.canon.shape[1]),
                    "pick": d.pick,
                    "predicted_us": d.predicted_us,
                    "measured_us": measured_s * 1e6,
                }
            )
