"""`corpusd up` on the ports it is given, and its calibration on first start (issue 19):
every daemon listens where its flag says, the agent's OpenAI API answers, a profile is measured
when there is none (stamped with the model, the device and the time), and bad port flags are
one line, exit 2, with nothing started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from corpusd.corpus.store import PageStore
from corpusd.model import fingerprint
from requester.calibrate import device_name
from requester.predicate import Profile
from tests.procs.test_up import alive, corpusd, daemon_pids
from tests.procs.test_up import home as home  # the fixture


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (bound, then released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_up_listens_on_the_given_ports_and_calibrates_first(
    home: dict[str, str], tiny_dir: Path
) -> None:
    env = {**home}
    env.pop("CORPUSD_CALIBRATE")  # auto: no profile yet, so this up calibrates
    c, h, a, http, m = free_ports(5)
    # --insecure: plain http for urllib here (tests/procs/test_security.py covers TLS)
    out = corpusd(env, "up", "--holders", "1", "--capacity-tokens", "1024", "--detach",
                  "--insecure", "--coordinator-port", str(c), "--holder-ports", str(h),
                  "--agent-port", str(a), "--metrics-ports", str(m),
                  "--http-port", str(http))  # fmt: skip
    root = Path(home["CORPUSD_HOME"]) / "up"
    pids = daemon_pids(root)
    try:
        info = json.loads((root / "up.json").read_text())
        assert info["coordinator"] == {"address": f"127.0.0.1:{c}", "metrics": m}
        assert info["holders"] == [{"address": f"127.0.0.1:{h}", "metrics": m + 1}]
        assert info["agent"] == {"address": f"127.0.0.1:{a}", "metrics": m + 2, "http": http}
        assert f"OpenAI API   http://127.0.0.1:{http}/v1" in out
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as r:
            assert json.loads(r.read()) == {"object": "list", "data": []}  # nothing pinned yet
        cal = info["calibration"]
        assert cal["ran"] and cal["ok"] and "there is no profile" in cal["why"], cal
        assert "calibration" in out and "quick" in out
        p = Profile.load(Path(cal["profile"]))
        assert p.mode == "quick" and p.model_fingerprint == fingerprint(tiny_dir)
        assert p.device == device_name() and p.created_at > 0 and p.alpha_us > 0
        # measured on holder-0 over a probe corpus, which is gone from the store after, and the
        # agent (started meanwhile) took the new profile up
        assert PageStore(Path(home["CORPUSD_HOME"]) / "store").ids() == []
        deadline = time.monotonic() + 10
        while "reloaded the cost-model profile" not in (root / "agent" / "agent.log").read_text():
            assert time.monotonic() < deadline, "the agent did not reload the profile"
            time.sleep(0.2)
        # a bad port flag is refused before anything starts, even beside a running up
        for args, words in [
            (["--holders", "2", "--holder-ports", "5000"], "--holder-ports: 1 ports for 2"),
            (["--agent-port", "70000"], "--agent-port: 70000"),
            (["--agent-port", str(c)], "in use"),
            (["--metrics-ports", "1,2"], "give one base port or 4"),
            (["--coordinator-port", "6000", "--agent-port", "6000"], "port 6000 is given twice"),
        ]:
            r = subprocess.run(
                [sys.executable, "-m", "corpusd", "up", "--state-dir", str(root.parent / "x"),
                 *args], env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert r.returncode == 2 and words in r.stderr, (args, r.stderr)
            assert r.stderr.count("\n") == 1 and not (root.parent / "x").exists(), r.stderr
    finally:
        corpusd(env, "down")
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(root / "up.json")
