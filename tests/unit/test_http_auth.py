"""The agent's OpenAI HTTP API asks for the agent's tokens as its gRPC port does (issue 20,
item 3): no or an unknown bearer token gets 401, a holder token 403, both as OpenAI-style JSON;
an agent or admin token reaches the app."""

from __future__ import annotations

import pytest

starlette = pytest.importorskip("starlette", reason="starlette serves the HTTP API (core dep)")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from requester.http import bearer_guard  # noqa: E402

TOKENS = {"a" * 32: "agent", "b" * 32: "admin", "c" * 32: "holder"}


async def _models(request: object) -> JSONResponse:
    return JSONResponse({"object": "list", "data": []})


@pytest.fixture
def client() -> TestClient:
    return TestClient(bearer_guard(Starlette(routes=[Route("/v1/models", _models)]), TOKENS))


@pytest.mark.parametrize(
    ("header", "status", "code"),
    [
        (None, 401, "invalid_api_key"),
        ("Bearer " + "z" * 32, 401, "invalid_api_key"),
        ("Basic " + "a" * 32, 401, "invalid_api_key"),
        ("Bearer " + "c" * 32, 403, "permission_denied"),
    ],
)
def test_refused(client: TestClient, header: str | None, status: int, code: str) -> None:
    r = client.get("/v1/models", headers={"Authorization": header} if header else {})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("token", ["a" * 32, "b" * 32])
def test_agent_and_admin_tokens_pass(client: TestClient, token: str) -> None:
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json() == {"object": "list", "data": []}
