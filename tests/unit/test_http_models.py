"""``/v1/models`` while the coordinator is down (issue 37: it answered 503 though chat on the
bound corpora still worked, and frameworks that list models first failed): the last list the
coordinator gave is served, marked stale in a field and a header; with no list ever read, the
corpora this worker has bound; with neither, 503."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

pytest.importorskip("starlette", reason="starlette serves the HTTP API (core dep)")

from corpusd.coordinator.client import CoordinatorError
from requester.http import OpenAIApi
from requester.metrics import RequesterMetrics


@dataclass
class _Corpus:
    corpus_id: str
    name: str
    tokens: int = 100
    state: str = "ready"
    model_fingerprint: str = ""
    created_at: str = ""


@dataclass
class _Coordinator:
    up: bool = True

    async def list_corpora(self) -> list[_Corpus]:
        if not self.up:
            raise CoordinatorError(grpc.StatusCode.UNAVAILABLE, "failed to connect")
        return [_Corpus("c" * 32, "docs")]


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [1, 2]


@dataclass
class _View:
    token_count: int = 50


@dataclass
class _Binding:
    view: _View = field(default_factory=_View)


@dataclass
class _Worker:
    corpora: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Svc:
    coordinator: _Coordinator = field(default_factory=_Coordinator)
    worker: _Worker = field(default_factory=_Worker)
    tok: _Tok = field(default_factory=_Tok)
    metrics: RequesterMetrics = field(default_factory=RequesterMetrics)
    fingerprint: str = ""


def _get(api: OpenAIApi) -> tuple[int, dict[str, Any], dict[str, str]]:
    r = asyncio.run(api.models(None))  # type: ignore[arg-type]
    return r.status_code, json.loads(bytes(r.body)), dict(r.headers)


def test_the_last_list_is_served_marked_stale_while_the_coordinator_is_down() -> None:
    svc = _Svc()
    api = OpenAIApi(svc)  # type: ignore[arg-type]
    status, body, headers = _get(api)
    assert status == 200 and [m["id"] for m in body["data"]] == ["docs"]
    assert "corpusd_stale" not in body and "x-corpusd-stale" not in headers
    svc.coordinator.up = False
    status, body, headers = _get(api)
    assert status == 200 and [m["id"] for m in body["data"]] == ["docs"], body
    assert "coordinator unavailable" in body["corpusd_stale"]
    assert "coordinator's list of" in headers["x-corpusd-stale"]


def test_without_a_list_the_bound_corpora_else_503() -> None:
    svc = _Svc(coordinator=_Coordinator(up=False))
    api = OpenAIApi(svc)  # type: ignore[arg-type]
    status, body, _ = _get(api)
    assert status == 503, body
    svc.worker.corpora["d" * 32] = _Binding()
    status, body, headers = _get(api)
    assert status == 200 and [m["id"] for m in body["data"]] == ["d" * 32], body
    assert "bound" in headers["x-corpusd-stale"]
