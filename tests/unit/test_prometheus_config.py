"""``corpusd prometheus-config``: the scrape config names a job per role, the metrics ports of
``up.json`` with the daemons' names as ``instance``, and ``up``'s CA, certificate and key by
absolute path; and those files are what a metrics port served the way ``up`` serves it (mutual
TLS, ``corpusd.daemon.listen``) takes, while a client without the certificate is refused."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from corpusd import cli, daemon, security
from corpusd.local_ca import ensure
from corpusd.metrics import Metrics
from corpusd.prometheus_config import render, scrape_configs
from corpusd.security import SecurityConfig


def up_info(state: Path, ports: tuple[int, ...], secure: bool = True) -> dict[str, Any]:
    """An ``up.json`` as ``corpusd up`` writes it: coordinator, holders, agent (ports: their
    metrics ports in that order)."""
    coord, *holders, agent = ports
    return {
        "pid": os.getpid(),
        "state_dir": str(state),
        "coordinator": {"address": "127.0.0.1:40000", "metrics": coord},
        "holders": [
            {"address": f"127.0.0.1:{41000 + i}", "metrics": p} for i, p in enumerate(holders)
        ],
        "agent": {"address": "127.0.0.1:42000", "metrics": agent, "http": -1},
        "security": {"dir": str(state / "tls")} if secure else None,
    }


def test_a_job_per_role_with_up_files(tmp_path: Path) -> None:
    info = up_info(tmp_path, (9200, 9201, 9202, 9203))
    doc = yaml.safe_load(render(info))
    assert doc == scrape_configs(info)  # the hand-written YAML reads back as the structure
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert list(jobs) == ["corpusd-coordinator", "corpusd-holder", "corpusd-agent"]
    got = {
        name: [(s["labels"]["instance"], *s["targets"]) for s in j["static_configs"]]
        for name, j in jobs.items()
    }
    assert got == {
        "corpusd-coordinator": [("coordinator", "127.0.0.1:9200")],
        "corpusd-holder": [("holder-0", "127.0.0.1:9201"), ("holder-1", "127.0.0.1:9202")],
        "corpusd-agent": [("agent", "127.0.0.1:9203")],
    }
    tls = tmp_path.resolve() / "tls"
    for j in jobs.values():
        assert j["scheme"] == "https"
        assert j["tls_config"] == {
            "ca_file": str(tls / "ca.pem"),
            "cert_file": str(tls / "node.pem"),
            "key_file": str(tls / "node.key"),
        }
        assert "authorization" not in j  # the metrics port checks no token


def test_insecure_up_is_plain_http_and_a_missing_port_is_left_out(tmp_path: Path) -> None:
    info = up_info(tmp_path, (9200, -1, 9203), secure=False)
    jobs = yaml.safe_load(render(info))["scrape_configs"]
    assert [j["job_name"] for j in jobs] == ["corpusd-coordinator", "corpusd-agent"]
    assert all(j["scheme"] == "http" and "tls_config" not in j for j in jobs)


def test_an_etcd_up_standby_coordinator_is_scraped_too(tmp_path: Path) -> None:
    info = up_info(tmp_path, (9200, 9201, 9203))
    info["coordinator"]["address"] = "127.0.0.1:40000,127.0.0.1:40001"  # up --state etcd
    (job, *_) = scrape_configs(info)["scrape_configs"]
    assert [s["labels"]["instance"] for s in job["static_configs"]] == ["coordinator"]  # not yet
    (tmp_path / "coordinator-1").mkdir()
    (tmp_path / "coordinator-1" / "endpoint.json").write_text(
        json.dumps({"address": "127.0.0.1:40001", "metrics_port": 9300, "pid": 1})
    )
    (job, *_) = scrape_configs(info)["scrape_configs"]
    got = [(s["labels"]["instance"], *s["targets"]) for s in job["static_configs"]]
    assert got == [("coordinator", "127.0.0.1:9200"), ("coordinator-1", "127.0.0.1:9300")]


def test_cli_writes_it_for_the_running_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "up"
    state.mkdir()
    out = tmp_path / "corpusd.yml"
    args = ["prometheus-config", "--state-dir", str(state), "--out", str(out)]
    assert cli.main(args) == 2  # no up.json: one line, nothing written
    assert "no running `corpusd up`" in capsys.readouterr().err and not out.exists()
    info = up_info(state, (9200, 9201, 9203))  # pid: this process, so it counts as running
    (state / "up.json").write_text(json.dumps(info))
    assert cli.main(args) == 0
    assert yaml.safe_load(out.read_text()) == scrape_configs(info)


def _get(url: str, ctx: ssl.SSLContext) -> tuple[int, str]:
    with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
        return r.status, r.read().decode()


def test_the_config_files_open_a_metrics_port_served_as_up_serves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder's metrics port as up starts it: its certificate, up's CA required of clients,
    and the tokens file (which guards gRPC only). The config's files get /metrics with no
    token; without the client certificate the handshake is refused."""
    ca = ensure(tmp_path / "tls")
    monkeypatch.setattr(security, "_server", None)  # restored after: configure sets both
    monkeypatch.setattr(security, "_configured", None)
    security.configure(
        SecurityConfig(str(ca.cert), str(ca.key), str(ca.ca), auth_tokens=str(ca.tokens))
    )
    m = Metrics("corpusd_holder_")
    m.gauge("elbow_flows", "test").set(7)

    async def scrape() -> None:
        served = await daemon.listen(lambda s: None, "test", "127.0.0.1", 0, 0, m.registry)
        try:
            info = up_info(tmp_path, (-1, served.metrics_port, -1))
            (job,) = yaml.safe_load(render(info))["scrape_configs"]
            tls = job["tls_config"]
            url = f"{job['scheme']}://{job['static_configs'][0]['targets'][0]}/metrics"
            ctx = ssl.create_default_context(cafile=tls["ca_file"])
            ctx.load_cert_chain(tls["cert_file"], tls["key_file"])
            status, body = await asyncio.to_thread(_get, url, ctx)
            assert status == 200 and "corpusd_holder_elbow_flows 7.0" in body
            bare = ssl.create_default_context(cafile=tls["ca_file"])  # trusts up, no cert
            with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
                await asyncio.to_thread(_get, url, bare)
        finally:
            await served.server.stop(0)

    asyncio.run(scrape())
