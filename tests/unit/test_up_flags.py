"""``corpusd up --detach`` re-runs itself in the background with every flag it was given (issue
19: port flags and calibration joined the config; a flag dropped on the way once lost the
holders' --kv-format). No daemon starts here: the re-exec is caught."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

import corpusd.up as up_mod
from corpusd.cli import build_parser
from corpusd.up import UpConfig


def test_the_background_up_gets_every_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = UpConfig(
        holders=3, store="/s", model="/m", capacity_tokens=2048, kv_format="fp8_e4m3", detach=1,
        timeout_s=99.0, coordinator_port=7001, holder_ports="7002,7003,7004", agent_port=7005,
        metrics_ports="7100", http_port=8000, calibrate="always", calibration_max_age_days=3.5,
        insecure=1, state="etcd", coordinator_advertise="10.0.0.1:7001,10.0.0.2:7001",
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
