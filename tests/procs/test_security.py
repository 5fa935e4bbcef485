"""TLS and tokens on a real secure ``corpusd up`` (issue 20, item 3): the CLI works after it
with no flags (up.json names its CA and tokens), a session decodes through mutual TLS with an
agent token, and every refusal is the one promised: no or unknown token UNAUTHENTICATED, a
token without the method's right PERMISSION_DENIED, plaintext or a client without a
certificate refused at the handshake. A refused call changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

from corpusd import security
from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from corpusd.local_ca import LocalCA
from corpusd.testing.cli import run_cli
from requester.client import AgentError, Client


def corpusd(
    env: dict[str, str], *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    r = run_cli(env, *args, timeout=300)
    assert not check or r.returncode == 0, f"corpusd {' '.join(args)}: {r.stdout}\n{r.stderr}"
    return r


@dataclass
class Up:
    env: dict[str, str]
    info: dict[str, object]
    ca: LocalCA

    def ident(self, right: str | None, cert: bool = True) -> security.Identity:
        c = self.ca
        token = c.token(right) if right else ""
        return security.identity_from(
            str(c.ca), str(c.cert) if cert else "", str(c.key) if cert else "", token
        )

    @property
    def coordinator(self) -> str:
        return str(self.info["coordinator"]["address"])  # type: ignore[index]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("secure-up")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORPUSD_")}
    env.update(CORPUSD_HOME=str(tmp / "home"), CORPUSD_MODEL=str(tiny_dir))
    src = tmp / "repo" / "pkg"
    src.mkdir(parents=True)
    (src / "a.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(16)))
    with tarfile.open(tmp / "repo.tar", "w") as tar:
        tar.add(tmp / "repo", arcname="repo")
    out = corpusd(env, "up", "--holders", "1", "--capacity-tokens", "2048", "--detach").stdout
    assert "TLS (mutual) and tokens" in out and "https://127.0.0.1:" in out
    try:
        # no TLS flag, no token: the CLI finds both through up.json
        out = corpusd(env, "pin", "--corpus", str(tmp / "repo.tar"), "--name", "repo").stdout
        assert "published via" in out
        info = json.loads((tmp / "home" / "up" / "up.json").read_text())
        yield Up(env, info, LocalCA(Path(info["security"]["dir"])))
    finally:
        corpusd(env, "down")


def test_up_made_private_files(up: Up) -> None:
    for p in up.ca.dir.iterdir():
        assert p.stat().st_mode & 0o777 == 0o600, f"{p} is {p.stat().st_mode & 0o777:o}"
    assert up.ca.dir.stat().st_mode & 0o777 == 0o700


def test_secure_session_decodes_with_an_agent_token(up: Up) -> None:
    async def go() -> list[int]:
        async with Client(coordinator=up.coordinator, ident=up.ident("agent")) as c:
            s = await c.open_session("repo", "\nQ: what does f3 return?")
            done = await c.complete(s, max_tokens=6)
            await c.close_session(s)
            return list(done.token_ids)

    assert len(asyncio.run(go())) == 6
    out = corpusd(up.env, "status").stdout  # the CLI, again with nothing given
    assert "repo" in out and "ready" in out


async def _coordinator_code(up: Up, ident: security.Identity, call: str) -> grpc.StatusCode:
    async with CoordinatorClient(up.coordinator, timeout=10, ident=ident) as c:
        try:
            if call == "unpin":
                await c.unpin_corpus("repo", False)
            elif call == "pin":
                await c.pin("repo", 1)
            else:
                await c.list_corpora()
        except CoordinatorError as e:
            return e.code
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("right", "call", "want"),
    [
        (None, "list", grpc.StatusCode.UNAUTHENTICATED),
        (None, "unpin", grpc.StatusCode.UNAUTHENTICATED),
        ("agent", "unpin", grpc.StatusCode.PERMISSION_DENIED),
        ("holder", "pin", grpc.StatusCode.PERMISSION_DENIED),
        ("agent", "list", grpc.StatusCode.OK),
    ],
)
def test_coordinator_rights(up: Up, right: str | None, call: str, want: grpc.StatusCode) -> None:
    assert asyncio.run(_coordinator_code(up, up.ident(right), call)) == want
    out = corpusd(up.env, "ls").stdout
    assert "repo" in out and "ready" in out  # a refused unpin changed nothing


def test_unknown_token_and_agent_without_token(up: Up) -> None:
    bogus = replace(up.ident("admin"), token="not-a-token-of-this-up-0123456789")
    assert asyncio.run(_coordinator_code(up, bogus, "list")) == grpc.StatusCode.UNAUTHENTICATED
    agent = str(up.info["agent"]["address"])  # type: ignore[index]

    async def open_without_token() -> grpc.StatusCode:
        async with Client(agent=agent, ident=up.ident(None)) as c:
            try:
                await c.open_session("repo", "hello")
            except AgentError as e:
                return e.code
        return grpc.StatusCode.OK

    assert asyncio.run(open_without_token()) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("how", ["plaintext", "no client certificate"])
def test_handshake_refusals(up: Up, how: str) -> None:
    ident = security.Identity() if how == "plaintext" else up.ident("admin", cert=False)
    addresses = [up.coordinator, str(up.info["agent"]["address"])]  # type: ignore[index]
    addresses += [str(h["address"]) for h in up.info["holders"]]  # type: ignore[attr-defined]

    async def health(address: str, ident: security.Identity) -> grpc.StatusCode:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with security.channel(address, ident=ident) as ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    for a in addresses:
        assert asyncio.run(health(a, ident)) == grpc.StatusCode.UNAVAILABLE, a
    # the same health call over mutual TLS is served (no token needed for health)
    assert asyncio.run(health(up.coordinator, up.ident(None))) == grpc.StatusCode.OK


def test_non_loopback_bind_needs_tls_or_insecure(up: Up, tmp_path: Path) -> None:
    r = corpusd(up.env, "serve", "--host", "0.0.0.0", "--state-dir", str(tmp_path), check=False)
    assert r.returncode == 2 and "is not loopback" in r.stderr and "--insecure" in r.stderr
    assert not (tmp_path / "endpoint.json").exists()


def test_tls_mistakes_are_named_in_one_line(up: Up, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a plaintext or certificate-less client read "UNAVAILABLE … Socket closed", an
    outage to the reader. corpusd's clients now say it is TLS, and what to pass."""
    monkeypatch.setenv("CORPUSD_HOME", up.env["CORPUSD_HOME"])  # the files of this up are named

    async def coordinator_detail(ident: security.Identity) -> str:
        async with CoordinatorClient(up.coordinator, timeout=10, ident=ident) as c:
            with pytest.raises(CoordinatorError) as e:
                await c.list_corpora()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            return e.value.detail

    plain = asyncio.run(coordinator_detail(security.Identity()))
    assert plain.startswith(f"TLS handshake failed: {up.coordinator} wants TLS"), plain
    assert f"CORPUSD_TLS_CA={up.ca.ca}" in plain and "\n" not in plain
    no_cert = asyncio.run(coordinator_detail(up.ident("admin", cert=False)))
    assert "asks for a client certificate" in no_cert and f"{up.ca.cert}" in no_cert, no_cert
    agent = str(up.info["agent"]["address"])  # type: ignore[index]

    async def agent_detail() -> str:
        async with Client(agent=agent, ident=security.Identity()) as c:
            with pytest.raises(AgentError) as e:
                await c.open_session("repo", "hello")
            return e.value.detail

    assert asyncio.run(agent_detail()).startswith(f"TLS handshake failed: {agent} wants TLS")
    r = corpusd(up.env, "ls", "--insecure", check=False)  # the CLI, told to speak plaintext
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "TLS handshake failed" in r.stderr and "Socket closed" not in r.stderr, r.stderr


def test_a_token_alone_works_with_ups_certificates(up: Up) -> None:
    """Issue 37: setting only CORPUSD_TOKEN dropped up's CA ("a bearer token is only sent over
    TLS: give a CA"); now it is sent with up's certificates to up's daemons."""
    env = {**up.env, "CORPUSD_TOKEN": up.ca.token("agent")}
    out = corpusd(env, "ls").stdout
    assert "repo" in out and "ready" in out
    r = corpusd(env, "unpin", "repo", check=False)  # that token's right, not admin's
    assert r.returncode == 2 and "PERMISSION_DENIED" in r.stderr, r.stderr


@pytest.mark.parametrize("token", ["short", "a-wrong-token-of-some-length-0123"])
def test_a_wrong_token_is_unauthenticated_whatever_its_length(up: Up, token: str) -> None:
    r = corpusd({**up.env, "CORPUSD_TOKEN": token}, "ls", check=False)
    assert r.returncode == 2 and "UNAUTHENTICATED" in r.stderr, r.stderr
    assert "16 characters" not in r.stderr
