"""``corpusd up --detach`` re-runs itself in the background with every flag it was given (issue
19: port flags and calibration joined the config; a flag dropped on the way once lost the
holders' --kv-format). No daemon starts here: the re-exec is caught."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import corpusd.up as up_mod
from corpusd.cli import build_parser
from corpusd.daemon import Daemon
from corpusd.up import UpConfig


def test_the_background_up_gets_every_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = UpConfig(
        holders=3, store="/s", model="/m", capacity_tokens=2048, kv_format="fp8_e4m3", detach=1,
        timeout_s=99.0, coordinator_port=7001, holder_ports="7002,7003,7004", agent_port=7005,
        metrics_ports="7100", http_port=8000, calibrate="always", calibration_max_age_days=3.5,
        insecure=1, state="etcd", session_idle_s=7.5, max_sessions=3,
        coordinator_advertise="10.0.0.1:7001,10.0.0.2:7001",
        holder_advertise="10.0.0.1:7002,,10.0.0.1:7004", agent_primitive="route",
    )  # fmt: skip
    defaults = UpConfig()
    changed = {f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)}
    assert changed == {f.name for f in fields(cfg)} - {"state_dir"}, "give every field a value"
    seen: list[list[str]] = []

    class Stop(Exception):
        pass

    def popen(args: list[str], **_: object) -> None:
        seen.append(args)
        raise Stop

    monkeypatch.setattr(up_mod.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        up_mod._detach(cfg, tmp_path)
    (args,) = seen
    assert args[1:4] == ["-m", "corpusd", "up"]
    a = build_parser().parse_args(args[3:])
    again = UpConfig(**{f.name: getattr(a, f.name) for f in fields(UpConfig)})
    assert again == UpConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)},
                                "detach": 0, "state_dir": str(tmp_path)})  # fmt: skip


def test_up_passes_session_lifetime_to_its_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's abandoned sessions outlived it: ``up`` had no ``--session-idle-s`` and passed
    none to its agent. Here ``up`` runs until it starts the agent (the other daemons are stubs)
    and the agent's argv is parsed by the agent's own parser."""
    seen: list[tuple[str, ...]] = []

    class Stop(Exception):
        pass

    def stub(name: str) -> Daemon:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        (tmp_path / name).mkdir(exist_ok=True)
        return Daemon(proc, tmp_path / name, "127.0.0.1:1", 0)

    def agent(*args: object, **_: object) -> Daemon:
        seen.append(tuple(str(a) for a in args[3:]))
        raise Stop

    monkeypatch.setattr(up_mod, "start_coordinator", lambda *a, **k: stub("coordinator"))
    monkeypatch.setattr(up_mod, "start_holder", lambda *a, **k: stub("holder-0"))
    monkeypatch.setattr(up_mod, "start_agent", agent)
    monkeypatch.setattr(up_mod.signal, "signal", lambda *a: None)  # leave pytest's handlers
    cfg = UpConfig(
        holders=1, state_dir=str(tmp_path / "up"), store=str(tmp_path / "store"),
        model=str(tmp_path / "m"), insecure=1, calibrate="off", session_idle_s=2.5,
        max_sessions=7,
    )  # fmt: skip
    with pytest.raises(Stop):
        up_mod.up(cfg)
    (args,) = seen
    a = build_parser().parse_args(["agent", *args])
    assert (a.session_idle_s, a.max_sessions) == (2.5, 7), args


def test_up_defaults_are_the_agents() -> None:
    from requester.config import AgentConfig

    agent = {f.name: f.default for f in fields(AgentConfig)}
    assert UpConfig().session_idle_s == agent["session_idle_s"]
    assert UpConfig().max_sessions == agent["max_sessions"]


def test_advertised_addresses_are_checked_and_default_to_the_daemons_own() -> None:
    assert UpConfig(holders=2).advertised() == ("", ["", ""])
    cfg = UpConfig(holders=3, coordinator_advertise="lb:7000", holder_advertise="a:1,,c:3")
    assert cfg.advertised() == ("lb:7000", ["a:1", "", "c:3"])
    bad = {
        "2 addresses for 3 holders": dict(holders=3, holder_advertise="a:1,b:2"),
        "--holder-advertise must be host:port": dict(holders=1, holder_advertise="a"),
        "port in 1..65535": dict(holders=1, holder_advertise="a:0"),
        "2 addresses for 1 coordinators": dict(coordinator_advertise="a:1,b:2"),
        "1 addresses for 2 coordinators": dict(coordinator_advertise="a:1", state="etcd"),
        "--coordinator-advertise must be host:port": dict(coordinator_advertise=":7"),
    }
    for want, kw in bad.items():
        with pytest.raises(ValueError, match=want):
            UpConfig(**kw)  # type: ignore[arg-type]


def test_a_holder_advertises_one_address() -> None:
    from holder.config import HolderConfig

    assert HolderConfig(store="/s", state_dir="/d", advertise="lb:7002").advertise == "lb:7002"
    for bad in ("lb", "lb:x", "a:1,b:2", "lb:70000"):
        with pytest.raises(ValueError, match="advertise must be host:port"):
            HolderConfig(store="/s", state_dir="/d", advertise=bad)


def test_the_agent_primitives_up_offers_are_the_agents() -> None:
    from corpusd.up_config import AGENT_PRIMITIVES
    from requester.predicate import PRIMITIVES

    assert ("auto", *PRIMITIVES) == AGENT_PRIMITIVES
    with pytest.raises(ValueError, match="agent_primitive must be one of"):
        UpConfig(agent_primitive="teleport")
