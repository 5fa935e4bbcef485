"""Run a ``tests/support/*_interpreted.py`` script in Triton's CPU interpreter, in a fresh
process: Triton decides at import whether its library functions are interpreted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: str) -> None:
    """Skip without triton; else run ``tests/support/<script>`` with ``TRITON_INTERPRET=1`` and
    assert it exits 0 and prints "cases ok" (its own asserts name a failing case)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton) — the interpreter test needs it")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / script)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "cases ok" in proc.stdout, proc.stdout
