"""Shared fixtures: the tiny checkpoint (written once per session) and the transformers oracle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU default (``corpusd model init``): BPE tokenizer, 16 × 64 indexer."""
    from corpusd.model.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def sglang_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``corpusd model init --preset sglang``: byte tokens, V3.2's 64 × 128 indexer."""
    from corpusd.model.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("sglang-model"), preset="sglang")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from corpusd.model import load_model

    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip(
        "transformers", reason="transformers is the test oracle: pip install -e '.[test]'"
    )
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One real etcd member on loopback for the session (tests take a fresh key prefix each)."""
    from corpusd.coordinator.etcd_local import etcd_binary, start_etcd

    if etcd_binary() is None:
        pytest.skip("no etcd binary: apt-get install etcd-server (the etcd state store's tests)")
    cluster = start_etcd(tmp_path_factory.mktemp("etcd"), 1)
    yield cluster
    cluster.stop()


def _state_flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    if request.param == "sqlite":
        return ()
    import uuid

    cluster = request.getfixturevalue("etcd")
    return ("--state", cluster.url(f"t{uuid.uuid4().hex[:12]}"))


@pytest.fixture(params=["sqlite", "etcd"])
def state_flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """``corpusd serve`` flags for each state store: none (SQLite, the default), then
    ``--state etcd://…/<fresh prefix>`` on the session's etcd (skipped without etcd)."""
    return _state_flags(request)


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def module_state_flags(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """``state_flags`` for a module's shared coordinator."""
    return _state_flags(request)
