"""The model a command uses without ``--model``: ``$CORPUSD_MODEL``, else the running
``corpusd up``'s (its daemons load only that one: a pin of the tiny default next to an ``up``
serving another model was refused by every holder), else the tiny default."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from corpusd.corpus.pin import default_model


def _up(home: Path, model: Path) -> None:
    """An ``up.json`` whose pid is this (live) process, serving ``model``."""
    (home / "up").mkdir(parents=True)
    info = {"pid": os.getpid(), "model": str(model), "coordinator": {"address": "127.0.0.1:1"}}
    (home / "up" / "up.json").write_text(json.dumps(info))


def test_a_running_up_s_model_is_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, model = tmp_path / "home", tmp_path / "odd-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("CORPUSD_HOME", str(home))
    monkeypatch.delenv("CORPUSD_MODEL", raising=False)
    _up(home, model)
    said = io.StringIO()
    assert default_model(said) == model
    assert said.getvalue() == (
        f"model {model}: the running `corpusd up`'s (--model or $CORPUSD_MODEL for another)\n"
    )
    named = tmp_path / "named"
    named.mkdir()
    (named / "config.json").write_text("{}")
    monkeypatch.setenv("CORPUSD_MODEL", str(named))  # the variable still wins
    assert default_model(io.StringIO()) == named


def test_an_up_whose_model_is_gone_leaves_the_tiny_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("CORPUSD_HOME", str(home))
    monkeypatch.delenv("CORPUSD_MODEL", raising=False)
    _up(home, tmp_path / "removed")
    assert default_model(io.StringIO()) == home / "models" / "tiny"
