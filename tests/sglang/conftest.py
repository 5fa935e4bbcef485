"""These tests run SGLang-shaped kernels (FlashMLA, SGLang's NSA indexer): their tiny model is
``corpusd model init --preset sglang``, not the CPU default."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dir(sglang_dir: Path) -> Path:
    return sglang_dir
