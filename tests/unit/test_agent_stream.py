"""A Generate stream whose client goes away ends its session as ``client_gone``, however gRPC
ends the handler. Cancelled while it awaits the next token, the handler sees CancelledError;
cancelled while gRPC awaits the send of a token, gRPC drops the response generator and it is
closed at its ``yield``: GeneratorExit. The second case left the session to the idle sweep (CI,
tests/procs/test_session_lifetime.py under load: "expired after idle", no "client left")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from requester.agent import AgentService


class _Agent(AgentService):
    def __init__(self) -> None:  # only what Generate touches
        self.gone: list[str] = []
        self.metrics = SimpleNamespace(requests=None)  # type: ignore[assignment]

    def params(self, *_: Any) -> Any:
        return None

    async def generate(self, session_id: str, params: Any) -> AsyncGenerator[Any, None]:
        while True:
            yield 7, "x", ""
            await asyncio.sleep(0.01)

    def client_gone(self, session_id: str) -> None:
        self.gone.append(session_id)


REQUEST = SimpleNamespace(session_id="s1", params=SimpleNamespace(
    max_tokens=9, temperature=0.0, top_p=0.0, stop_token_ids=[], seed=0))  # fmt: skip


def test_a_stream_closed_at_its_yield_ends_the_session_as_client_gone() -> None:
    async def go() -> list[str]:
        agent = _Agent()
        stream = agent.Generate(REQUEST, None)
        await stream.__anext__()  # a token handed to gRPC, which never asks for the next
        await stream.aclose()  # type: ignore[attr-defined]
        return agent.gone

    assert asyncio.run(go()) == ["s1"]


def test_a_stream_cancelled_while_awaiting_a_token_ends_the_session_as_client_gone() -> None:
    async def go() -> list[str]:
        agent = _Agent()
        stream = agent.Generate(REQUEST, None)

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return agent.gone

    assert asyncio.run(go()) == ["s1"]
