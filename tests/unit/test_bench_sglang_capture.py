"""``bench_sglang --pin-engine``'s capture server (tools/sglang_server.py): a stock SGLang
command line whose HiCache backups go to a spool through corpusd's backend in capture mode, the
flags ``corpusd pin --engine`` checks for (CPU: the command is built and its process reaped;
sglang need not be installed)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.sglang_server import Server


def test_capture_server_runs_stock_with_the_capture_backend(tmp_path: Path) -> None:
    s = Server("capture", tmp_path / "model", 1, None, tmp_path / "capture.log")
    try:
        cmd = s.cmd
    finally:
        s.stop()
    flag = {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("--")}
    assert flag["--hicache-write-policy"] == "write_through"  # backed up right after prefill
    assert flag["--hicache-storage-backend"] == "dynamic" and "--enable-hierarchical-cache" in cmd
    extra = json.loads(flag["--hicache-storage-backend-extra-config"])
    assert extra["corpusd_capture"] == str(tmp_path / "spool-capture")
    assert extra["module_path"] == "requester.sglang.hicache" and "corpusd_store" not in extra
    assert extra["model_path"] == str(tmp_path / "model")
    assert "--disable-cuda-graph" in cmd  # no graphs asked for: the capture server only prefills
