"""A checkpoint SGLang's DeepSeek-V3.2 computes otherwise than its config means stops a server
with the plugin at start, naming the field (``requester/sglang/model_check.py``; the rules are
tested on CPU in ``tests/unit/test_sglang_model_check.py``). ``pytest -m sglang``: skipped with
the reason without sglang or an SM90 GPU; it never runs in CPU CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from corpusd.model.config import RopeConfig
from corpusd.model.tiny import init_tiny
from tests.support.checks import why_no_sglang_gpu

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(bool(why_no_sglang_gpu()), reason=why_no_sglang_gpu()),
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "override, names",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"rope": RopeConfig(kind="linear", factor=4.0)}, "linear"),
    ],
    ids=["attention_bias", "linear-rope"],
)
def test_a_model_sglang_computes_otherwise_stops_the_server_at_start(
    tmp_path: Path, override: dict[str, Any], names: str
) -> None:
    from tools.sglang_server import SGLANG_ENV, sglang_flags

    model = init_tiny(tmp_path / "model", preset="sglang", index_topk=2048, **override)
    env = {
        **os.environ,
        **SGLANG_ENV,
        "SGLANG_EXTERNAL_MODEL_PACKAGE": "requester.sglang",
        "CORPUSD_COORDINATOR": "127.0.0.1:1",
    }  # fmt: skip  (refused before it is dialled)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--port", "30391", *sglang_flags(), "--disable-cuda-graph"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "corpusd plugin:" in out and names in out, out[-3000:]
