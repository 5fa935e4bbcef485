"""``corpusd pin --device``: its refusals on this machine, and the GPU benchmark's code path run
on the CPU (``tools/bench_pin.py --device cpu`` is the same code as ``--device cuda:0``)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.corpus.pin import PinConfig, pin
from corpusd.corpus.store import PageStore

ROOT = Path(__file__).resolve().parents[2]


def test_device_flag_is_validated_and_a_missing_gpu_is_refused_before_any_write(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'gpu'"):
        PinConfig(corpus="x", device="gpu")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("print('hello')\n" * 20)
    store = tmp_path / "store"
    if torch.cuda.is_available():
        bad = f"cuda:{torch.cuda.device_count()}"
        msg = "CUDA device(s) are visible"
    else:
        bad, msg = "cuda:0", "sees no CUDA GPU"
    with pytest.raises(ValueError, match=msg):
        pin(PinConfig(corpus=str(src), model=str(tiny_dir), store=str(store), device=bad))
    assert not store.exists() or not any(store.rglob("*.safetensors"))
    args = ["pin", "--corpus", str(src), "--model", str(tiny_dir), "--store", str(store)]
    assert cli_main([*args, "--device", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("corpusd: error: --device") and err.count("\n") == 1


def test_cpu_device_pin_equals_the_default_pin(tmp_path: Path, tiny_dir: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_bytes((ROOT / "corpusd" / "corpus" / "pin.py").read_bytes())
    store = PageStore(tmp_path / "store")
    cfg = PinConfig(corpus=str(src), model=str(tiny_dir), store=str(store.root))
    a = pin(cfg, io.StringIO()).manifest
    b = pin(PinConfig(**{**_fields(cfg), "device": "cpu", "chunk": 1024}), io.StringIO())
    # Another chunking of the same prefill: the same corpus, found already pinned.
    assert b.reused and b.manifest.corpus_id == a.corpus_id and a.token_count > 2 * 128


def _fields(cfg: PinConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_bench_pin_runs_its_device_path_on_the_cpu(tmp_path: Path) -> None:
    """The command the lead runs on a GPU box, with ``--device cpu`` and tiny sizes: the same
    functions (init of the SGLang preset, corpus cut to a token count, pin in a child process,
    the JSON it writes)."""
    out = tmp_path / "pin.json"
    cmd = [
        sys.executable, "-m", "tools.bench_pin", "--device", "cpu", "--preset", "sglang",
        "--sizes", "600", "--chunk", "1024", "--dtype", "bfloat16", "--no-tar", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["preset"] == "sglang" and res["dtype"] == "bfloat16" and res["chunk"] == 1024
    (row,) = res["rows"]
    assert 560 <= row["tokens"] <= 640, f"{row=}: the corpus is cut to about 600 tokens"
    assert row["tok_per_s"] > 0 and row["indexer_gflop"] > 0
