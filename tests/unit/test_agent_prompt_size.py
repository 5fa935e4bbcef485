"""A prompt over ``--max-prompt-tokens`` is refused before it is built (issue 34: the fuzz run's
agent RSS growth). OpenSession turned every id of a refused prompt of millions into a Python int
first, and glibc kept the heap those lists grew; the agent's RSS rose with every such request.
The refusal is the same; what it allocates is measured here, with tracemalloc (Python's own
allocations, deterministic for a given request)."""

from __future__ import annotations

import asyncio
import tracemalloc
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from corpusd.rpc import Reject
from corpusd.tokenizer import ByteTokenizer
from corpusd.v1 import agent_pb2
from requester.agent import TEXT_CHARS_PER_TOKEN, AgentService


class _Agent(AgentService):
    def __init__(self) -> None:  # only what OpenSession's checks touch
        self.cfg = SimpleNamespace(max_prompt_tokens=64)  # type: ignore[assignment]
        self.tok = ByteTokenizer()
        self.opened: list[list[int]] = []

    async def open_session(self, corpus: str, prompt: list[int]) -> Any:
        self.check_prompt_size(len(prompt))
        self.opened.append(prompt)
        raise Reject(grpc.StatusCode.NOT_FOUND, "no corpus here")


def _open(agent: _Agent, request: Any) -> tuple[Reject, int]:
    """OpenSession's body (the Rpc wrapper aside): its refusal and the peak bytes it allocated."""
    tracemalloc.start()
    try:
        with pytest.raises(Reject) as e:
            asyncio.run(AgentService.OpenSession.__wrapped__(agent, request, None))  # type: ignore[attr-defined]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return e.value, peak


def test_an_oversized_id_list_is_refused_without_building_it() -> None:
    ids = list(range(1000, 1000 + 1_000_000))  # ints above the small-int cache, as the fuzz sent
    request = agent_pb2.OpenSessionRequest(corpus="c", tokens=agent_pb2.TokenList(ids=ids))
    del ids
    agent = _Agent()
    refused, peak = _open(agent, request)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "1000000 tokens; this agent takes at most 64" in str(refused)
    # built, the list alone is 8 MB of pointers and 28 MB of ints
    assert peak < 1 << 20, f"refusing it allocated {peak:,} bytes"
    assert agent.opened == []


def test_an_oversized_text_is_refused_unread_and_a_fitting_one_is_encoded() -> None:
    agent = _Agent()
    text = "x" * (64 * TEXT_CHARS_PER_TOKEN + 1)
    refused, peak = _open(agent, agent_pb2.OpenSessionRequest(corpus="c", text=text))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{len(text):,} characters; this agent reads at most" in str(refused)
    assert peak < 1 << 20 and agent.opened == []
    # under the character bound but over the token limit: encoded, then refused on its count
    refused, _ = _open(agent, agent_pb2.OpenSessionRequest(corpus="c", text="y" * 65))
    assert "65 tokens; this agent takes at most 64" in str(refused) and agent.opened == []
    refused, _ = _open(agent, agent_pb2.OpenSessionRequest(corpus="c", text="ok"))
    assert refused.code == grpc.StatusCode.NOT_FOUND and agent.opened == [list(b"ok")]
