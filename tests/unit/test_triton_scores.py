"""The Triton index-score kernel against ``indexer.index_scores``, in Triton's CPU interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_triton_scores_interpreted_match_reference() -> None:
    """``tests/support/triton_scores_interpreted.py`` in a fresh process (Triton decides at
    import whether it interprets): exact and fp8 arithmetic, odd head counts and widths."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton) — the interpreter test needs it")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "triton_scores_interpreted.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "cases ok" in proc.stdout, proc.stdout
