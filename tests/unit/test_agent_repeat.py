"""corpusd's own agent refuses a prompt that repeats its corpus (``corpusd.corpus.head``), by
the head the coordinator published or, for a corpus bound without a coordinator (``--holders``),
by the head of the tokens the worker read from the page store; the question alone is served."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from corpusd.rpc import Reject
from requester.agent import AgentService
from requester.metrics import RequesterMetrics

CORPUS = [0, *torch.randint(2, 300, (199,), generator=torch.Generator().manual_seed(7)).tolist()]


class _Agent(AgentService):
    def __init__(self, tokens: torch.Tensor | None) -> None:  # what open_session touches
        self.cfg = SimpleNamespace(  # type: ignore[assignment]
            max_prompt_tokens=4096, max_sessions=8, kv_capacity_tokens=1 << 20, session_idle_s=0
        )
        self.metrics = RequesterMetrics()
        self.heads = {}
        self.opened: list[list[int]] = []
        binding = SimpleNamespace(
            view=SimpleNamespace(corpus_id="c0ffee", token_count=len(CORPUS)), tokens=tokens
        )
        self.worker = SimpleNamespace(  # type: ignore[assignment]
            mcfg=SimpleNamespace(vocab_size=320), sessions={}, open=self._open
        )
        self._binding = binding

    async def corpus(self, name: str) -> Any:  # type: ignore[override]
        return self._binding

    def _open(self, cid: str, prompt: list[int]) -> Any:
        self.opened.append(prompt)
        return SimpleNamespace(id="s1")


def _open(agent: _Agent, prompt: list[int]) -> None:
    asyncio.run(agent.open_session("repo", prompt))


def test_a_corpus_bound_without_a_coordinator_is_checked_by_its_stored_tokens() -> None:
    agent = _Agent(torch.tensor(CORPUS))
    with pytest.raises(Reject) as e:
        _open(agent, [5, 6, *CORPUS[1:], 9])  # its text after a template's tokens
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt: repeats corpus 'repo' (its tokens 1-64 stand at the prompt's 2-65)" in str(
        e.value
    )
    assert agent.metrics.prompts_refused.labels("repeats_corpus")._value.get() == 1
    _open(agent, [5, 6, 9])
    assert agent.opened == [[5, 6, 9]]


def test_no_tokens_and_no_published_head_claims_nothing() -> None:
    agent = _Agent(None)
    _open(agent, list(CORPUS))
    assert agent.opened == [CORPUS]
