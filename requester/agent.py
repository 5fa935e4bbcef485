"""The Agent service (``corpusd agent``): sessions over pinned corpora, streamed generation, and
the low-level merged Attend for external engines.

A corpus is named by id, name or an id prefix of at least 8 characters; the first session of a
corpus binds it (page table from the coordinator, or the holders' own reports without one;
while the coordinator is unreachable, the holders' reports for the corpus as the agent's last
snapshot of the coordinator names it: :mod:`requester.bind_snapshot`).
Every refusal carries a precise status and message and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError, CorpusStatus
from corpusd.corpus.head import corpus_head, repeated
from corpusd.corpus.names import CorpusNameError, resolve_name
from corpusd.rpc import Reject, Rpc, wire
from corpusd.tokenizer import Tokenizer
from corpusd.v1 import agent_pb2, agent_pb2_grpc
from corpusd.wire import from_proto, to_proto
from requester import bind_snapshot
from requester.config import AgentConfig
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.fanout import CorpusBinding
from requester.sampling import SamplingParams
from requester.scheduler import Scheduler, SessionBusy
from requester.session import Session
from requester.worker import Worker

log = logging.getLogger("corpusd.agent")
Code = grpc.StatusCode
#: ended sessions remembered, so a call on one says why it is gone (expired, closed, ...)
ENDED_KEPT = 4096
#: characters of text a prompt may have per token of ``--max-prompt-tokens``: past it the text
#: is refused unread (tokenizers average 1 to about 6 characters a token; 64 leaves room for
#: runs of whitespace that some vocabularies hold as one token)
TEXT_CHARS_PER_TOKEN = 64
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


def _status(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The statuses of the agent's own failures (``Rpc`` answers Reject and the unexpected)."""
    if isinstance(e, CoordinatorError):
        code = Code.UNAVAILABLE if e.code == Code.UNAVAILABLE else e.code
        return code, f"coordinator: {e.detail}"
    if isinstance(e, CorpusUnavailable):
        return Code.UNAVAILABLE, str(e)
    if isinstance(e, grpc.aio.AioRpcError):
        return Code.UNAVAILABLE, f"a holder failed: {e.code().name}: {e.details()}"
    return None


rpc = Rpc(log, requests=lambda service: service.metrics.requests, status=_status)


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(
        self,
        cfg: AgentConfig,
        worker: Worker,
        tokenizer: Tokenizer,
        coordinator: CoordinatorClient | None,
        holders: tuple[str, ...] = (),
        fingerprint: str = "",
    ) -> None:
        self.cfg, self.worker, self.tok, self.fingerprint = cfg, worker, tokenizer, fingerprint
        self.coordinator, self.holders = coordinator, holders
        self.metrics = worker.metrics
        self.scheduler = Scheduler(worker, cfg.max_batch)
        self.names: dict[str, str] = {}  # what callers named → corpus id
        # corpus id → (name, its head: corpusd/corpus/head.py) as the coordinator published it
        self.heads: dict[str, tuple[str, int, str]] = {}
        self.lease_s = 10.0  # the coordinator's, from its answer to each load report
        self._binding = asyncio.Lock()
        self.ended: OrderedDict[str, str] = OrderedDict()  # session id → why it is gone
        self.metrics.session_rows.set_function(self.kv_tokens)

    async def _abort(self, method: str, e: Exception, context: Any) -> None:
        await rpc.abort(self, method, e, context)

    # -- corpora -----------------------------------------------------------------------------------
    async def corpus(self, name: str) -> CorpusBinding:
        """The attached corpus ``name`` refers to, binding it on first use."""
        if not name:
            raise Reject(Code.INVALID_ARGUMENT, "corpus: empty; name a pinned corpus (id or name)")
        cid = self.names.get(name, name)
        if cid in self.worker.corpora:
            return self.worker.corpora[cid]
        async with self._binding:
            cid = self.names.get(name, name)
            if cid in self.worker.corpora:
                return self.worker.corpora[cid]
            if self.coordinator is not None:
                st = await self._bind_from_coordinator(name)
            else:
                try:
                    st = await self.worker.attach(name, self.holders)
                except CorpusUnavailable as e:
                    raise Reject(Code.NOT_FOUND, str(e)) from None
            self.names[name] = st.view.corpus_id
            log.info(
                "bound corpus %s (%d tokens) on %d holders",
                st.view.corpus_id,
                st.view.token_count,
                len(st.view.holders),
            )
            return st

    def unbind(self, corpus_id: str, why: str) -> None:
        """Forget a corpus this worker bound (the coordinator says it is no longer pinned): its
        binding with every cached page and key, the names that led to it, its sessions (a stream
        in flight ends NOT_FOUND). The next session of that name binds afresh."""
        for sid in [s.id for s in self.worker.sessions.values() if s.corpus.corpus_id == corpus_id]:
            self.scheduler.cancel(
                sid, Reject(Code.NOT_FOUND, f"corpus {corpus_id} was {why}; session {sid} closed")
            )
        closed = self.worker.detach(corpus_id)
        for sid in closed:
            self._ended(sid, "unpinned", f"was closed: its corpus {corpus_id[:12]} was {why}")
        self.names = {n: c for n, c in self.names.items() if c != corpus_id}
        log.info("dropped corpus %s (%s): %d sessions closed", corpus_id[:12], why, len(closed))

    async def _bind_from_coordinator(self, name: str) -> CorpusBinding:
        """Bind ``name`` by the coordinator's corpus list and page table, and record both in
        the snapshot (bind_snapshot.py); while the coordinator is unreachable, by the snapshot
        and what its holders say they hold."""
        assert self.coordinator is not None
        try:
            corpora = await self.coordinator.list_corpora()
        except CoordinatorError as e:
            if e.code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                raise
            return await self._bind_from_snapshot(name, e)
        match = self._check_model(_match(corpora, name))
        table = await self.coordinator.page_table(match.corpus_id)
        b = await self.worker.attach_table(table, self._reread(match.corpus_id))
        addresses = sorted({h.address for h in table.holders.values()})
        bind_snapshot.save(Path(self.cfg.state_dir), corpora, match.corpus_id, addresses)
        return b

    async def _bind_from_snapshot(self, name: str, e: CoordinatorError) -> CorpusBinding:
        """Bind ``name`` while the coordinator is unreachable (``e``): resolved by the last
        corpus list it gave, placed by what that corpus's holders say they hold now (why a
        stale snapshot gives no wrong token: bind_snapshot.py). Raises ``e`` when there is no
        snapshot or it does not know ``name``."""
        snap = bind_snapshot.load(Path(self.cfg.state_dir))
        if snap is None:
            raise e
        try:
            match = _match(list(snap.corpora), name)
        except Reject:  # the coordinator may know it: say what failed
            raise e from None
        match = self._check_model(match)
        cid = match.corpus_id
        b = await self.worker.attach(cid, snap.addresses(cid), self._reread(cid))
        b.from_snapshot = snap.saved_at
        self.metrics.snapshot_binds.inc()
        log.warning(
            "coordinator unavailable (%s): corpus %s bound from the coordinator snapshot (%s) "
            "and its holders' own page lists; its page table is re-read when the coordinator "
            "answers",
            e.detail,
            cid[:12],
            snap.age(),
        )
        return b

    def _check_model(self, match: CorpusStatus) -> CorpusStatus:
        """``match`` when it was pinned for this agent's model (its head kept for
        :meth:`open_session`'s check), else Reject FAILED_PRECONDITION."""
        fp = self.fingerprint
        if fp and match.model_fingerprint and match.model_fingerprint != fp:
            raise Reject(
                Code.FAILED_PRECONDITION,
                f"corpus {match.corpus_id} was pinned for model {match.model_fingerprint[:12]}…; "
                f"this agent runs {fp[:12]}…",
            )
        self.heads[match.corpus_id] = (match.name, match.head_len, match.head_digest)
        return match

    def _reread(self, cid: str) -> Callable[[], Awaitable[CorpusView]]:
        """A failover with no live replica asks the coordinator again."""
        coordinator = self.coordinator
        assert coordinator is not None

        async def reread() -> CorpusView:
            return CorpusView.from_page_table(await coordinator.page_table(cid))

        return reread

    def table_refresh_s(self) -> float:
        """How often bound page tables are re-read: ``--table-refresh-s``, else lease / 3."""
        return self.cfg.table_refresh_s or max(self.lease_s, 0.3) / 3

    # -- sessions ----------------------------------------------------------------------------------
    def _session(self, session_id: str) -> Session:
        s = self.worker.sessions.get(session_id)
        if s is None:
            why = self.ended.get(session_id)
            if why is not None:
                raise Reject(Code.NOT_FOUND, f"session {session_id} {why}; open a new session")
            raise Reject(Code.NOT_FOUND, f"no session {session_id!r} on this agent")
        s.used_at = time.monotonic()
        return s

    def _ended(self, session_id: str, reason: str, why: str) -> None:
        """Remember why ``session_id`` is gone (its next call says so) and count it."""
        self.ended[session_id] = why
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        self.metrics.sessions_closed.labels(reason).inc()

    def _end(self, session_id: str, reason: str, why: str) -> None:
        """Close an open session for ``reason`` (a stream it runs fails NOT_FOUND with
        ``why``)."""
        self.scheduler.cancel(session_id, Reject(Code.NOT_FOUND, f"session {session_id} {why}"))
        self.worker.close_session(session_id)
        self._ended(session_id, reason, why)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Close every session no call has used for ``--session-idle-s`` (a client that exited
        without CloseSession); a session with a stream in flight is in use. Returns their ids."""
        idle_s = self.cfg.session_idle_s
        if idle_s <= 0:
            return []
        now = time.monotonic() if now is None else now
        gone = [
            s.id
            for s in list(self.worker.sessions.values())
            if now - s.used_at > idle_s and not self.scheduler.busy(s.id)
        ]
        for sid in gone:
            self._end(sid, "idle", f"expired after idle {idle_s:g} s (--session-idle-s)")
        if gone:
            log.info("%d sessions expired after idle %g s", len(gone), idle_s)
        return gone

    async def expire_idle_loop(self) -> None:
        """``expire_idle`` every quarter of the timeout (at most 5 s apart)."""
        every = min(max(self.cfg.session_idle_s / 4, 0.1), 5.0)
        while self.cfg.session_idle_s > 0:
            await asyncio.sleep(every)
            self.expire_idle()

    @rpc("OpenSession")
    async def OpenSession(self, request: Any, context: Any) -> agent_pb2.OpenSessionResponse:
        which = request.WhichOneof("prompt")
        if which is None:
            raise Reject(Code.INVALID_ARGUMENT, "prompt: give text or tokens")
        if which == "tokens":
            self.check_prompt_size(len(request.tokens.ids))  # before a Python int per id
            prompt = list(request.tokens.ids)
        else:
            prompt = self.encode(request.text)
        s, st = await self.open_session(request.corpus, prompt)
        return agent_pb2.OpenSessionResponse(
            session_id=s.id,
            corpus_tokens=st.view.token_count,
            prompt_tokens=len(prompt),
            prompt_ids=prompt,
            corpus_id=st.view.corpus_id,
        )

    def check_prompt_size(self, tokens: int) -> None:
        """Refuse a prompt of ``tokens`` tokens over ``--max-prompt-tokens``, before it is built:
        a refused prompt of millions of ids made into Python ints left the agent's heap larger
        after every such request (the fuzz run's RSS growth)."""
        if tokens > self.cfg.max_prompt_tokens:
            raise Reject(
                Code.INVALID_ARGUMENT,
                f"prompt: {tokens} tokens; this agent takes at most {self.cfg.max_prompt_tokens} "
                "(--max-prompt-tokens)",
            )

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids. A text longer than TEXT_CHARS_PER_TOKEN characters per token
        ``--max-prompt-tokens`` allows is refused unread (INVALID_ARGUMENT), as an id list over
        the limit is."""
        limit = self.cfg.max_prompt_tokens * TEXT_CHARS_PER_TOKEN
        if len(text) > limit:
            raise Reject(
                Code.INVALID_ARGUMENT,
                f"prompt: {len(text):,} characters; this agent reads at most {limit:,} "
                f"({TEXT_CHARS_PER_TOKEN} per token of --max-prompt-tokens "
                f"{self.cfg.max_prompt_tokens})",
            )
        ids = self.tok.encode(text)
        self.check_prompt_size(len(ids))
        return ids

    async def open_session(self, corpus: str, prompt: list[int]) -> tuple[Session, CorpusBinding]:
        """Fork ``corpus`` (id, name or id prefix) with the token ids ``prompt`` after it: what
        OpenSession and the HTTP API's requests do. Raises Reject (every refusal OpenSession
        documents) and changes nothing then."""
        cfg = self.cfg
        if not prompt:
            raise Reject(Code.INVALID_ARGUMENT, "prompt: empty; a session needs at least a token")
        self.check_prompt_size(len(prompt))
        vocab = self.worker.mcfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise Reject(
                Code.INVALID_ARGUMENT, f"prompt: token ids {bad[:4]} are outside [0, {vocab})"
            )
        if len(self.worker.sessions) >= cfg.max_sessions:
            self.expire_idle()
        if len(self.worker.sessions) >= cfg.max_sessions:
            self.metrics.sessions_refused.labels("max_sessions").inc()
            idle = f"{cfg.session_idle_s:g} s" if cfg.session_idle_s > 0 else "off"
            raise Reject(
                Code.RESOURCE_EXHAUSTED,
                f"max sessions {cfg.max_sessions} reached (--max-sessions); close some "
                f"(CloseSession) or wait: idle ones expire (--session-idle-s: {idle})",
            )
        if self.kv_tokens() + len(prompt) > cfg.kv_capacity_tokens:
            self.metrics.sessions_refused.labels("kv_capacity").inc()
            raise Reject(
                Code.RESOURCE_EXHAUSTED,
                f"sessions hold {self.kv_tokens():,} of {cfg.kv_capacity_tokens:,} cache rows; "
                f"no room for a prompt of {len(prompt):,}",
            )
        st = await self.corpus(corpus)
        cid = st.view.corpus_id
        if cid not in self.heads and st.tokens is not None:  # bound without a coordinator
            self.heads[cid] = (corpus, *corpus_head(st.tokens))
        name, head_len, digest = self.heads.get(cid, (cid, 0, ""))
        twice = repeated(prompt, head_len, digest, name, st.view.token_count)
        if twice is not None:
            self.metrics.prompts_refused.labels("repeats_corpus").inc()
            raise Reject(Code.INVALID_ARGUMENT, f"prompt: {twice}")
        s = self.worker.open(cid, prompt)
        log.info("session %s on %s: %d prompt tokens", s.id, st.view.corpus_id[:12], len(prompt))
        return s, st

    def close_session(self, session_id: str) -> None:
        """End a session (its stream, if one runs, fails CANCELLED). Raises Reject NOT_FOUND."""
        s = self._session(session_id)
        self.scheduler.cancel(
            s.id, Reject(Code.CANCELLED, f"session {s.id} was closed while generating")
        )
        self.worker.close_session(s.id)
        self._ended(s.id, "close", "was closed (CloseSession)")

    def kv_tokens(self) -> int:
        """Cache rows the open sessions hold or are about to (pending tokens)."""
        # a list first: the metrics endpoint calls this from its own thread
        return sum(s.cache.length + len(s.pending) for s in list(self.worker.sessions.values()))

    def params(
        self,
        max_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 0.0,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
    ) -> SamplingParams:
        """Checked sampling parameters (``max_tokens`` 0: the agent's default; ``top_p`` 0:
        off). Raises Reject INVALID_ARGUMENT naming the parameter."""
        cfg, vocab = self.cfg, self.worker.mcfg.vocab_size
        max_tokens = max_tokens or min(cfg.default_max_tokens, cfg.max_new_tokens)
        if max_tokens > cfg.max_new_tokens:
            raise Reject(
                Code.INVALID_ARGUMENT,
                f"max_tokens: {max_tokens}; this agent generates at most {cfg.max_new_tokens} "
                "per call (--max-new-tokens)",
            )
        if max_tokens < 0:
            raise Reject(Code.INVALID_ARGUMENT, f"max_tokens: {max_tokens}; must be >= 1")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise Reject(Code.INVALID_ARGUMENT, f"temperature: {temperature}; must be >= 0")
        if not (math.isfinite(top_p) and 0 <= top_p <= 1):
            raise Reject(Code.INVALID_ARGUMENT, f"top_p: {top_p}; must be in [0, 1] (0 = off)")
        bad = [t for t in stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise Reject(Code.INVALID_ARGUMENT, f"stop_token_ids: {bad[:4]} outside [0, {vocab})")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p or 1.0,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )

    async def generate(
        self, session_id: str, params: SamplingParams
    ) -> AsyncGenerator[tuple[int, str, str], None]:
        """Each new token of the session, the text it adds and the session's finish reason
        ("" until its last token, then "stop" or "length"), as sampled (the session joins the
        running batch): what Generate streams and the HTTP API's answers are made of. Raises
        Reject (no such session, busy, finished) before the first token, or what failed a step."""
        t0 = time.perf_counter()
        s = self._session(session_id)
        if self.scheduler.busy(s.id):
            raise Reject(Code.FAILED_PRECONDITION, f"session {s.id} is already generating")
        if s.done:
            raise Reject(
                Code.FAILED_PRECONDITION,
                f"session {s.id} has finished ({s.finish_reason}); open a new session",
            )
        s.gen.manual_seed(params.seed)
        # The budget counts from this call: tokens generated before it do not use it up.
        s.params = replace(params, max_tokens=len(s.generated) + params.max_tokens)
        text, last = _TextStream(self.tok), t0
        first = True
        try:
            async for tok in self.scheduler.generate(s):
                s.used_at = time.monotonic()
                now = time.perf_counter()
                (self.metrics.ttft if first else self.metrics.inter_token).observe(now - last)
                first, last = False, now
                yield tok, text.push(tok), s.finish_reason
        except SessionBusy as e:
            raise Reject(Code.FAILED_PRECONDITION, str(e)) from None

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        method = "Generate"
        try:
            p = request.params
            params = self.params(p.max_tokens, p.temperature, p.top_p, p.stop_token_ids, p.seed)
            async for tok, text, finish in self.generate(request.session_id, params):
                yield agent_pb2.GenerateChunk(token_ids=[tok], text=text, finish_reason=finish)
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled the stream or went away (exited, killed, its connection
            # dropped): nobody is left to continue or close the session, so it ends here.
            # CancelledError when gRPC cancels us awaiting the next token; GeneratorExit when
            # it was cancelled awaiting a token's send, and drops (closes) this generator.
            self.client_gone(request.session_id)
            raise
        except Exception as e:
            await self._abort(method, e, context)
        self.metrics.requests.labels(method, "OK").inc()

    def client_gone(self, session_id: str) -> None:
        """End a session whose client left mid-stream (no-op if it is closed already)."""
        if session_id in self.worker.sessions:
            self._end(session_id, "client_gone", "was closed: its client left mid-stream")
            log.info("session %s closed: its client left mid-stream", session_id)

    @rpc("CloseSession")
    async def CloseSession(self, request: Any, context: Any) -> agent_pb2.CloseSessionResponse:
        self.close_session(request.session_id)
        return agent_pb2.CloseSessionResponse()

    # -- low level ---------------------------------------------------------------------------------
    @rpc("Attend")
    async def Attend(self, request: Any, context: Any) -> agent_pb2.AgentAttendResponse:
        mc = self.worker.mcfg
        st = await self.corpus(request.corpus)
        if not 0 <= request.layer < mc.num_hidden_layers:
            raise Reject(
                Code.INVALID_ARGUMENT,
                f"layer: {request.layer}; the model has {mc.num_hidden_layers} layers",
            )
        q = wire(lambda: from_proto(request.q, "q", dtypes=_FLOATS, rank=3, finite=True))
        n = q.shape[0]
        want = (mc.num_attention_heads, mc.kv_dim)
        if tuple(q.shape[1:]) != want:
            raise Reject(
                Code.INVALID_ARGUMENT, f"q: shape {list(q.shape)}; want [n, {want[0]}, {want[1]}]"
            )
        if not 0 < n <= self.cfg.max_attend_rows:
            raise Reject(
                Code.INVALID_ARGUMENT, f"q: {n} rows; 1 to {self.cfg.max_attend_rows} accepted"
            )
        scale = request.scale or mc.softmax_scale
        if not (math.isfinite(scale) and scale > 0):
            raise Reject(
                Code.INVALID_ARGUMENT, f"scale: {request.scale}; must be > 0 (0 = model's)"
            )
        positions = iq = iw = None
        if request.positions.dtype:
            positions = wire(
                lambda: from_proto(request.positions, "positions", dtypes=_INTS, rank=2)
            ).to(torch.int64)
            t = st.view.token_count
            if positions.shape[0] != n:
                raise Reject(
                    Code.INVALID_ARGUMENT, f"positions: {positions.shape[0]} rows, q has {n}"
                )
            if positions.numel() and not bool(((positions >= -1) & (positions < t)).all()):
                raise Reject(
                    Code.INVALID_ARGUMENT,
                    f"positions: outside [-1, {t}) (the corpus has {t} tokens; -1 = unused)",
                )
        elif request.index_q.dtype:
            iq = wire(
                lambda: from_proto(request.index_q, "index_q", dtypes=_FLOATS, rank=3, finite=True)
            )
            iw = wire(
                lambda: from_proto(
                    request.index_weights, "index_weights", dtypes=_FLOATS, rank=2, finite=True
                )
            )
            hi, di = mc.index_n_heads, mc.index_head_dim
            if tuple(iq.shape) != (n, hi, di) or tuple(iw.shape) != (n, hi):
                raise Reject(
                    Code.INVALID_ARGUMENT,
                    f"index_q {list(iq.shape)} / index_weights {list(iw.shape)}; want "
                    f"[{n}, {hi}, {di}] / [{n}, {hi}]",
                )
        else:
            raise Reject(Code.INVALID_ARGUMENT, "give positions, or index_q and index_weights")
        o, lse = await self.worker.attend(
            st.view.corpus_id, request.layer, q, positions, iq, iw, scale
        )
        return agent_pb2.AgentAttendResponse(o=to_proto(o.to(q.dtype)), lse=to_proto(lse.float()))

    async def close(self) -> None:
        await self.scheduler.close()


_NAME_CODES = {
    "unknown": Code.NOT_FOUND,
    "not_ready": Code.FAILED_PRECONDITION,
    "ambiguous": Code.INVALID_ARGUMENT,
}


def _match(corpora: list[CorpusStatus], name: str) -> CorpusStatus:
    """The ready corpus ``name`` means (``resolve_name``: an id, a unique name, or a unique id
    prefix of ≥ 8 characters); refused NOT_FOUND, FAILED_PRECONDITION or INVALID_ARGUMENT."""
    try:
        return resolve_name(name, corpora)
    except CorpusNameError as e:
        where = ""
        if e.state == "queued":
            c = next(c for c in corpora if c.corpus_id == e.corpus_id)
            where = f" (queue position {c.queue_position})"
        raise Reject(_NAME_CODES[e.reason], f"{e}{where}") from None


class _TextStream:
    """Incremental detokenisation: the text each new token adds, holding back a trailing
    partial UTF-8 character until it completes. Each push decodes only the tokens since the
    last emitted text (plus the one before, for tokenizers whose spacing depends on it), so a
    long answer costs linear, not quadratic, decoding."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids = tok, list[int]()
        self.prefix = self.read = 0  # ids[prefix:read] decode to text already sent

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd"):
            return ""
        sent = self.tok.decode(self.ids[self.prefix : self.read])
        self.prefix, self.read = max(self.read - 1, 0), len(self.ids)
        return text[len(sent) :]
