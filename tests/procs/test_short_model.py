"""A model that reads few positions (``max_position_embeddings`` below the corpus): a pin over
it is refused naming the model's bound, not a flag that cannot raise it, and ``corpusd
calibrate``, whose sample repository is longer than such a model reads, calibrates over a probe
corpus as long as the model reads instead of failing (both found running a held-out config)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from corpusd.corpus.pin import sample_repo
from corpusd.testing.cli import run_cli


def _short_model(tiny_dir: Path, dst: Path, positions: int) -> Path:
    shutil.copytree(tiny_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_short_model_refuses_a_long_pin_by_name_and_calibrates(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _short_model(tiny_dir, tmp_path / "short", 1024)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORPUSD_")}
    env["CORPUSD_HOME"] = str(tmp_path / "home")
    monkeypatch.setenv("CORPUSD_HOME", env["CORPUSD_HOME"])  # sample_repo writes its tar there
    r = run_cli(env, "pin", "--corpus", str(sample_repo()), "--model", str(model), timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "token limit of 1,024" in r.stderr and "reads at most 1,024 positions" in r.stderr
    assert "--max-tokens" not in r.stderr, r.stderr  # no flag raises the model's bound
    out = tmp_path / "profile.json"
    r = run_cli(env, "calibrate", "--model", str(model), "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "calibrating over a probe corpus of 1,024 random tokens instead" in r.stdout
    assert json.loads(out.read_text())["model_fingerprint"], "no profile written"
    corpora = tmp_path / "home" / "store" / "corpora"
    assert not corpora.exists() or not any(corpora.iterdir()), "a corpus in the user's store"
