"""Continuous batching: every session with a Generate stream in flight is stepped together.

A stream joins at the next step (its prompt is prefilled in the same forward pass as the others'
decode tokens) and leaves when it finishes or its caller goes away; the loop idles when no
stream is open. A failed step fails the streams in it and leaves their sessions as they were
before the step (a session's length commits only at the end of a step), so they may retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from requester.session import Session
from requester.worker import Worker

log = logging.getLogger("corpusd.requester")


class SessionBusy(Exception):
    """The session already has a Generate stream in flight."""


@dataclass(eq=False)
class _Stream:
    session: Session
    out: asyncio.Queue[int | BaseException | None] = field(default_factory=asyncio.Queue)


class Scheduler:
    """Steps every open stream of ``worker`` together, at most ``max_batch`` sessions a step
    (the oldest first; the rest wait their turn in arrival order)."""

    def __init__(self, worker: Worker, max_batch: int = 64) -> None:
        assert max_batch > 0, f"{max_batch=}"
        self.worker, self.max_batch = worker, max_batch
        self.streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def busy(self, session_id: str) -> bool:
        return session_id in self.streams

    async def generate(self, session: Session) -> AsyncIterator[int]:
        """The session's new tokens as they are sampled, until it finishes. Raises SessionBusy,
        or what failed its step. Leaving early (the caller cancelled) removes it from the batch."""
        if session.id in self.streams:
            raise SessionBusy(f"session {session.id} is already generating")
        st = _Stream(session)
        self.streams[session.id] = st
        self.worker.metrics.generating.set(len(self.streams))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="corpusd-scheduler")
        self._wake.set()
        try:
            while True:
                item = await st.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self.streams.get(session.id) is st:
                del self.streams[session.id]
            self.worker.metrics.generating.set(len(self.streams))

    def cancel(self, session_id: str, error: BaseException) -> None:
        """End a session's stream with ``error`` (its session is being closed)."""
        st = self.streams.pop(session_id, None)
        if st is not None:
            st.out.put_nowait(error)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.streams:
                batch = list(self.streams.values())[: self.max_batch]
                t0 = time.perf_counter()
                try:
                    events = await self.worker.step([st.session for st in batch])
                except Exception as e:
                    log.warning("step of %d sessions failed: %s", len(batch), e, exc_info=True)
                    for st in batch:
                        if self.streams.get(st.session.id) is st:
                            del self.streams[st.session.id]
                        st.out.put_nowait(e)
                    continue
                self.worker.metrics.batch.observe(len(batch))
                log.debug(
                    "stepped %d sessions in %.1f ms", len(batch), (time.perf_counter() - t0) * 1e3
                )
                for st, (s, tok) in zip(batch, events, strict=True):
                    st.out.put_nowait(tok)
                    if s.done:
                        st.out.put_nowait(None)
                        if self.streams.get(s.id) is st:
                            del self.streams[s.id]
                # rotate: sessions beyond max_batch get the next step
                if len(self.streams) > self.max_batch:
                    for st in batch:
                        if self.streams.get(st.session.id) is st:
                            self.streams[st.session.id] = self.streams.pop(st.session.id)
