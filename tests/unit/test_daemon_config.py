"""``DaemonConfig``: the fields and checks every daemon role shares, their flags, and the one
way a daemon of a role is started (``corpusd.daemon.start``; no process runs here)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from corpusd import daemon
from corpusd.cli import build_parser
from corpusd.coordinator.config import CoordinatorConfig, PublishConfig
from corpusd.corpus.config import PinConfig
from corpusd.daemon_config import DaemonConfig, non_negative, positive
from corpusd.up_config import UpConfig
from holder.config import HolderConfig
from requester.config import AgentConfig

ROLES = (CoordinatorConfig, HolderConfig, AgentConfig)
BASE = [f.name for f in fields(DaemonConfig)]


@pytest.mark.parametrize("cls", ROLES)
def test_every_role_extends_the_base_and_its_checks(cls: type[DaemonConfig]) -> None:
    assert issubclass(cls, DaemonConfig) and [f.name for f in fields(cls)][: len(BASE)] == BASE
    ok = cls(store="s", state_dir="d")
    assert (ok.host, ok.port, ok.metrics_port, ok.drain_s) == ("127.0.0.1", 0, 0, 5.0)
    bads: tuple[tuple[dict[str, Any], str], ...] = (
        (dict(store=""), f"{cls.ROLE}: needs a page store and a state directory"),
        (dict(port=70000), "port must be in 0..65535"),
        (dict(metrics_port=-2), "metrics_port must be in -1..65535"),
        (dict(drain_s=-1.0), r"drain_s must be >= 0, got -1\.0"),
    )
    for bad, says in bads:
        with pytest.raises(ValueError, match=says):
            cls(**{"store": "s", "state_dir": "d", **bad})


COMMANDS = [("serve", CoordinatorConfig), ("holder", HolderConfig), ("agent", AgentConfig)]


@pytest.mark.parametrize(("command", "cls"), COMMANDS)
def test_flags_derive_from_the_whole_class_and_defaults_fill_in(
    command: str, cls: type[DaemonConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORPUSD_HOME", str(tmp_path))
    monkeypatch.delenv("CORPUSD_STORE", raising=False)
    a = build_parser().parse_args([command, "--port", "7", "--drain-s", "1.5"])
    cfg = cls.from_flags(a)
    assert (cfg.port, cfg.drain_s) == (7, 1.5)
    assert cfg.state_dir == str(tmp_path / cls.STATE_HOME) and cfg.store == str(tmp_path / "store")
    sub = next(x for x in build_parser()._actions if isinstance(x, argparse._SubParsersAction))
    help_text = sub.choices[command].format_help()
    assert f"$CORPUSD_HOME/{cls.STATE_HOME}" in " ".join(help_text.split())


def test_the_positive_checks_name_the_field() -> None:
    ns = argparse.Namespace(a=1, b=0, c=-0.5, d=float("nan"))
    positive(ns, "a")
    non_negative(ns, "a", "b")
    with pytest.raises(ValueError, match="b must be > 0, got 0"):
        positive(ns, "a", "b")
    with pytest.raises(ValueError, match=r"c must be >= 0, got -0\.5"):
        non_negative(ns, "c")
    with pytest.raises(ValueError, match="d must be > 0, got nan"):
        positive(ns, "d")
    for make, says in (
        (lambda: PinConfig(corpus="x", engine_timeout=0), "engine_timeout must be > 0"),
        (lambda: UpConfig(timeout_s=0), "timeout_s must be > 0"),
        (lambda: PublishConfig(wait_s=-1), "wait_s must be >= 0"),
        (lambda: HolderConfig(store="s", state_dir="d", max_k=0), "max_k must be > 0"),
    ):
        with pytest.raises(ValueError, match=says):
            make()


@pytest.mark.parametrize("role", sorted(daemon.ROLES))
def test_one_start_for_every_role(
    role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[Any, ...]] = []

    def spawn(*a: Any) -> tuple[Any, Path, str, int]:
        seen.append(a)
        return None, a[3], "127.0.0.1:1", 2

    monkeypatch.setattr(daemon, "spawn", spawn)
    d = daemon.start(role, tmp_path, "--x", store=Path("/s"), model=Path("/m"))
    ((r, command, args, state_dir, timeout, env),) = seen
    assert (r, command, state_dir, env) == (role, daemon.ROLES[role].command, tmp_path, None)
    assert (
        args == ["--store", "/s", "--model", "/m", "--x"]
        and timeout == daemon.ROLES[role].timeout_s
    )
    assert (d.address, d.metrics_port) == ("127.0.0.1:1", 2)
    with pytest.raises(KeyError):
        daemon.start("nobody", tmp_path)
