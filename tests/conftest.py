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
