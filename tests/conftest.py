"""Shared fixtures: the tiny checkpoint (written once per session) and the transformers oracle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from corpusd.model.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny-model"))


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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a − b|| / ||b|| in float64."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm())


def why_no_sglang_gpu() -> str:
    """Why the ``sglang`` tests cannot run here, or "" when they can: they need sglang installed
    and an SM90 GPU (FlashMLA's sparse kernels, which the NSA backend runs)."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install 'corpusd[sglang]', or .sglang-deps/)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"FlashMLA sparse needs SM90; this is SM{torch.cuda.get_device_capability()}"
    return ""
