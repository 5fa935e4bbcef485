"""Bad input to a live SGLang server with the plugin (issue 17, item 4; ``pytest -m sglang``).

Runs ``tools/bench_sglang.py --probe-only``: a route server over a pinned corpus, then

- one request each with an unknown corpus, a malformed ``corpusd:`` id, and a bound prompt that
  repeats its corpus: HTTP 400 with the reason in one line, and the server answers a normal
  request afterwards;
- 8 good requests at once, alone and then with a request bound to an unknown corpus sent while
  they are in flight: the bad one is refused within 1 s, the 8 get the tokens they got alone,
  and the server stays up.

SGLang keeps an aborted request queued for a one-token prefill, so before admission remembered
its refusals the forward raised the same binding error and the scheduler died (an H100 run).
Skipped with the reason without sglang or an SM90 GPU; it never runs in CPU CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checks import why_no_sglang_gpu

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(bool(why_no_sglang_gpu()), reason=why_no_sglang_gpu()),
]
ROOT = Path(__file__).resolve().parents[2]


def test_requests_it_cannot_bind_fail_alone_and_fast(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    cmd = [
        sys.executable, "-m", "tools.bench_sglang", "--probe-only", "--regimes", "sparse",
        "--holder-device", "cuda:0", "--fit-steps", "0", "--out", str(out),
        "--work", str(tmp_path / "work"),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    log = tmp_path / "work" / "sglang-route.log"
    assert run.returncode == 0 and out.exists(), f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    got = json.loads(out.read_text())
    probe = got["binding_probe"]["sparse"]
    for label in ("unknown corpus", "malformed id", "repeats its corpus"):
        assert probe[label]["http"] == 400, (label, probe[label], log)
        assert "corpusd:" in probe[label]["body"], probe[label]
    assert "repeats corpus" in probe["repeats its corpus"]["body"], probe
    assert probe["after"] == {"tokens": 4, "server_alive": True}, probe["after"]
    c = got["concurrent_probe"]["sparse"]
    assert c["bad"]["http"] == 400 and c["bad"]["s"] < 1.0, c["bad"]
    assert c["good_same_tokens"] == c["good"] == 8, c
    assert c["server_alive"], c
