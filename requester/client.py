"""``requester.Client``: the Python client of the Agent API.

    async with Client(coordinator="127.0.0.1:7000") as c:
        s = await c.open_session("sample-repo", "\\nQ: where is the page store?\\nA:")
        async for chunk in c.generate(s, max_tokens=32):
            print(chunk.text, end="")
        await c.close_session(s)

With a coordinator, each new session goes to the worker the coordinator picks (batch and KV
headroom); with ``agent=`` every session goes to that one worker. A refused call raises
AgentError with the server's status and message.

A worker that dies costs a coordinator-backed client no token: the client keeps each session's
tokens (the prompt as the worker tokenized it, then every token it streamed), and when a
Generate stream breaks with UNAVAILABLE it opens the session anew on another worker from the
corpus id and those tokens, and streams on from there, without a gap or a repeat. A greedy
stream resumes token for token; a sampled one resumes with its seed from the resume point.
Opening a session (or reopening one) on a worker that does not answer (UNAVAILABLE: dead, and
the coordinator has not noticed yet) is retried on another worker the coordinator picks; a
coordinator that is unavailable (restarting) is waited for, up to COORDINATOR_WAIT_S.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import torch

from corpusd import security
from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from corpusd.rpc import StatusError
from corpusd.v1 import agent_pb2, agent_pb2_grpc
from corpusd.wire import from_proto, to_proto

#: workers an OpenSession (or a resume) tries before it gives up
OPEN_TRIES = 4
#: seconds a worker choice waits for an unavailable coordinator (a restart) before it fails
COORDINATOR_WAIT_S = 20.0


class AgentError(StatusError):
    """The agent (or the coordinator choosing one) refused; ``code`` is the gRPC status."""


@dataclass(frozen=True, slots=True)
class SessionRef:
    session_id: str
    address: str  # the agent worker hosting it
    corpus_tokens: int
    prompt_tokens: int
    corpus_id: str = ""


@dataclass
class _Resumable:
    """What rebuilds a session elsewhere: where it lives now and every token it holds."""

    ref: SessionRef
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "" until the last chunk: "stop" or "length"


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str


class Client:
    def __init__(
        self,
        agent: str = "",
        coordinator: str = "",
        timeout: float = 120.0,
        ident: security.Identity | None = None,
    ) -> None:
        """``ident``: TLS and token (default: this process's: flags, ``CORPUSD_TLS_*`` and
        ``CORPUSD_TOKEN``, else a running secure ``corpusd up``'s; see corpusd.security)."""
        if not (agent or coordinator):
            raise ValueError("give an agent address or a coordinator address")
        self.agent, self.timeout, self.ident = agent, timeout, ident
        self.coordinator = (
            CoordinatorClient(coordinator, timeout=timeout, ident=ident) if coordinator else None
        )
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, agent_pb2_grpc.AgentStub] = {}
        self._attend_at = ""  # the worker chosen for Attend calls
        self._sessions: dict[str, _Resumable] = {}  # by the id open_session returned
        self.reopened = 0  # OpenSession calls sent again to another worker (one was dead)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        if self.coordinator is not None:
            await self.coordinator.close()

    def _stub(self, address: str) -> agent_pb2_grpc.AgentStub:
        if address not in self._stubs:
            ch = security.channel(
                address,
                ident=self.ident,
                options=[
                    ("grpc.max_receive_message_length", 256 << 20),
                    ("grpc.max_send_message_length", 256 << 20),
                ],
            )
            self._channels[address], self._stubs[address] = ch, agent_pb2_grpc.AgentStub(ch)
        return self._stubs[address]

    async def _where(self, session_tokens: int, exclude: Sequence[str] = ()) -> str:
        if self.coordinator is None:
            return self.agent
        # A coordinator restarting (or one whose workers have not reported since it came back)
        # answers UNAVAILABLE for seconds: wait for it, with backoff, up to COORDINATOR_WAIT_S.
        deadline, pause = time.monotonic() + COORDINATOR_WAIT_S, 0.1
        while True:
            try:
                _, address = await self.coordinator.choose_worker(session_tokens, exclude)
                return address
            except CoordinatorError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() + pause > deadline:
                    raise AgentError(e.code, f"coordinator: {e.detail}") from None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)

    async def open_session(
        self, corpus: str, prompt: str | Sequence[int], reserve_tokens: int = 256
    ) -> SessionRef:
        """Fork ``corpus`` (id, name or id prefix) with ``prompt`` (text, or token ids) after it.
        ``reserve_tokens`` is the answer length the worker choice should leave room for."""
        req = agent_pb2.OpenSessionRequest(corpus=corpus)
        if isinstance(prompt, str):
            req.text = prompt
            estimate = len(prompt.encode())
        else:
            req.tokens.SetInParent()  # an empty list is still the tokens choice
            req.tokens.ids.extend(prompt)
            estimate = len(prompt)
        r, address = await self._open(req, estimate + reserve_tokens)
        ref = SessionRef(r.session_id, address, r.corpus_tokens, r.prompt_tokens, r.corpus_id)
        self._sessions[ref.session_id] = _Resumable(ref, list(r.prompt_ids))
        return ref

    async def generate(
        self,
        session: SessionRef,
        max_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
    ) -> AsyncIterator[Chunk]:
        """Stream the session's next tokens (``max_tokens`` 0 = the agent's default). With a
        coordinator, a worker that dies mid-stream is replaced (see the module docstring)."""
        params = agent_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
        )
        live = self._sessions.get(session.session_id)
        streamed = 0
        while True:
            ref = live.ref if live is not None else session
            call = self._stub(ref.address).Generate(
                agent_pb2.GenerateRequest(session_id=ref.session_id, params=params)
            )
            try:
                async for c in call:
                    if live is not None:
                        live.tokens += c.token_ids
                    streamed += len(c.token_ids)
                    yield Chunk(tuple(c.token_ids), c.text, c.finish_reason)
                return
            except grpc.aio.AioRpcError as e:
                dead = e.code() == grpc.StatusCode.UNAVAILABLE
                if not (dead and live is not None and live.tokens and self.coordinator):
                    raise await self._error(e, ref.address) from None
            if max_tokens and streamed >= max_tokens:  # died after its last token
                yield Chunk((), "", "length")
                return
            live.ref = await self._resume(live, ref.address)
            if max_tokens:
                params.max_tokens = max_tokens - streamed

    async def _resume(self, live: _Resumable, dead: str) -> SessionRef:
        """The session opened anew on a worker other than ``dead``, from its tokens."""
        req = agent_pb2.OpenSessionRequest(corpus=live.ref.corpus_id)
        req.tokens.ids.extend(live.tokens)
        r, address = await self._open(req, len(live.tokens) + 256, exclude=[dead])
        return replace(live.ref, session_id=r.session_id, address=address)

    async def _open(
        self, req: Any, session_tokens: int, exclude: Sequence[str] = ()
    ) -> tuple[Any, str]:
        """OpenSession on the worker the coordinator picks; a worker that does not answer
        (UNAVAILABLE: it died and its lease has not run out) is excluded and the coordinator
        asked again, up to OPEN_TRIES workers. Returns ``(reply, address)``; raises AgentError
        (the last worker's, or the coordinator's when no worker is left)."""
        gone = list(exclude)
        for attempt in range(OPEN_TRIES):
            address = await self._where(session_tokens, exclude=gone)
            try:
                r = await self._call(
                    self._stub(address).OpenSession(req, timeout=self.timeout), address
                )
            except AgentError as e:
                last = attempt == OPEN_TRIES - 1
                if e.code != grpc.StatusCode.UNAVAILABLE or self.coordinator is None or last:
                    raise
                gone.append(address)
                self.reopened += 1
                continue
            return r, address
        raise AssertionError("unreachable: the last try raises")

    async def complete(self, session: SessionRef, **params: Any) -> Completion:
        """``generate`` collected: every token, the text and why it stopped."""
        ids: list[int] = []
        text, reason = [], ""
        async for c in self.generate(session, **params):
            ids += c.token_ids
            text.append(c.text)
            reason = c.finish_reason
        return Completion(tuple(ids), "".join(text), reason)

    async def close_session(self, session: SessionRef) -> None:
        live = self._sessions.pop(session.session_id, None)
        ref = live.ref if live is not None else session
        req = agent_pb2.CloseSessionRequest(session_id=ref.session_id)
        await self._call(
            self._stub(ref.address).CloseSession(req, timeout=self.timeout), ref.address
        )

    async def attend(
        self,
        corpus: str,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor | None = None,
        index_q: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        scale: float = 0.0,
        address: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged ``(O [n, h, d_v], LSE [n, h])`` of ``q [n, h, kv_dim]`` over the corpus at
        canonical positions: ``positions [n, k]`` (-1 unused), or corpusd's own top-k by
        ``index_q``/``index_weights``. ``scale`` 0 = the model's."""
        req = agent_pb2.AgentAttendRequest(corpus=corpus, layer=layer, q=to_proto(q), scale=scale)
        if positions is not None:
            req.positions.CopyFrom(to_proto(positions.to(torch.int64)))
        if index_q is not None and index_weights is not None:
            req.index_q.CopyFrom(to_proto(index_q))
            req.index_weights.CopyFrom(to_proto(index_weights))
        if not (address or self.agent or self._attend_at):
            # Attend is stateless: one worker choice serves every later call (each choice counts
            # as a session at the coordinator until the worker's next report).
            self._attend_at = await self._where(0)
        stub = self._stub(address or self.agent or self._attend_at)
        try:
            r: Any = await self._call(stub.Attend(req, timeout=self.timeout))
        except AgentError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                self._attend_at = ""  # that worker is gone: choose again next call
            raise
        floats = (torch.float32, torch.bfloat16, torch.float16)
        return (
            from_proto(r.o, "o", dtypes=floats, rank=3),
            from_proto(r.lse, "lse", dtypes=(torch.float32,), rank=2),
        )

    async def _call(self, call: Any, address: str = "") -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise await self._error(e, address) from None

    async def _error(self, e: grpc.aio.AioRpcError, address: str) -> AgentError:
        """The AgentError of a failed call to ``address``: a connection failure that is a TLS
        mistake says which (one line)."""
        detail = e.details() or ""
        if e.code() == grpc.StatusCode.UNAVAILABLE and address:
            from corpusd.tls_diagnosis import explain

            me = self.ident if self.ident is not None else security.client_identity(address)
            detail = await asyncio.to_thread(explain, address, detail, me)
        return AgentError(e.code(), detail)
