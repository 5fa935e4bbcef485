"""Test helpers: a pinned corpus and real ``corpusd holder`` processes on loopback."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from corpusd.corpus.pin import PinConfig, pin


def pin_sample(tmp: Path, model_dir: Path, tokens: int = 1000) -> str:
    """Pin ~``tokens`` byte tokens of text into ``tmp/store``; returns the corpus id."""
    body = "".join(f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(tokens))[
        :tokens
    ]
    src = tmp / "repo.tar"
    with tarfile.open(src, "w") as tar:
        info = tarfile.TarInfo("src/main.txt")
        data = body.encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    r = pin(
        PinConfig(corpus=str(src), model=str(model_dir), store=str(tmp / "store")), io.StringIO()
    )
    return r.manifest.corpus_id


@dataclass
class HolderProc:
    proc: subprocess.Popen[bytes]
    state_dir: Path
    address: str
    metrics_port: int

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def start_holder(store: Path, state_dir: Path, model_dir: Path, *extra: str) -> HolderProc:
    state_dir.mkdir(parents=True, exist_ok=True)
    endpoint = state_dir / "endpoint.json"
    endpoint.unlink(missing_ok=True)
    log = (state_dir / "holder.log").open("ab")
    cmd = [
        sys.executable,
        "-m",
        "corpusd",
        "holder",
        "--store",
        str(store),
        "--state-dir",
        str(state_dir),
        "--model",
        str(model_dir),
        "--threads",
        "1",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    deadline = time.monotonic() + 120
    while not endpoint.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(
                f"holder did not start: {(state_dir / 'holder.log').read_text()[-3000:]}"
            )
        time.sleep(0.05)
    ep = json.loads(endpoint.read_text())
    return HolderProc(proc, state_dir, ep["address"], ep["metrics_port"])
