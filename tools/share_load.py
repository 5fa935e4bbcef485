"""``tools/bench_share.py``'s load generator: closed-loop clients streaming SGLang's
``/generate``, in threads of one process or dealt over several (spawned: each also imports the
running bench's main module, so all are started, and report ready, before a trial's clock
starts). Standard library only. One Python process parses about 12,000 streamed tokens a
second at most on a 2-core CPU machine (``tools/bench_client_cap.py``), and in a closed loop a
client that reads late starts its next session late, so the bench spreads its clients.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import resource
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: client number → the request bodies it sends, one session after the other
Work = dict[int, list[dict[str, Any]]]


class Session:
    """One streamed request to the server at ``url``: first-token time, per-token gaps, and the
    tokens it produced."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        t0 = time.monotonic()
        self.ttft, self.gaps, self.tokens, self.error = math.nan, [], 0, ""
        last = t0
        req = urllib.request.Request(
            url + "/generate",
            json.dumps({**body, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    now, got = time.monotonic(), json.loads(line[5:])
                    if "error" in got:
                        self.error = str(got["error"])[:300]
                        break
                    n = len(got.get("output_ids", []))
                    if n > self.tokens:
                        if self.tokens == 0:
                            self.ttft = now - t0
                        else:  # a chunk of k new tokens: k gaps of (now - last) / k
                            self.gaps += [(now - last) / (n - self.tokens)] * (n - self.tokens)
                        self.tokens, last = n, now
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"[:300]


def run_clients(urls: list[str], work: Work) -> list[Session]:
    """A thread per client ``w`` of ``work``: its sessions back to back on
    ``urls[w % len(urls)]``."""

    def client(w: int) -> list[Session]:
        return [Session(urls[w % len(urls)], body) for body in work[w]]

    with ThreadPoolExecutor(len(work)) as pool:
        return [s for got in pool.map(client, sorted(work)) for s in got]


def cpu_s() -> float:
    """This process's CPU seconds so far (user and system, every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _client_process(urls: list[str], work: Work, ready: Any, go: Any, out: Any) -> None:
    """A load-generator process: say it is up, wait for the trial's start, run its clients, put
    (sessions as tuples, this process's CPU seconds over them) on ``out``."""
    ready.put(os.getpid())
    go.wait()
    t0 = cpu_s()
    got = run_clients(urls, work)
    out.put(([(s.ttft, s.gaps, s.tokens, s.error) for s in got], cpu_s() - t0))


def load_in_processes(
    urls: list[str], work: Work, procs: int
) -> tuple[list[Session], float, list[float]]:
    """``work``'s clients dealt over ``procs`` processes (client ``w`` to process ``w mod
    procs``), all started and waiting before the clock does: (sessions, wall seconds from the
    start to the last process's end, each process's CPU seconds)."""
    mp = multiprocessing.get_context("spawn")
    ready, out, go = mp.Queue(), mp.Queue(), mp.Event()
    shares = [{w: b for w, b in work.items() if w % procs == p} for p in range(procs)]
    kids = [mp.Process(target=_client_process, args=(urls, sh, ready, go, out)) for sh in shares]
    for k in kids:
        k.start()
    try:
        for _ in kids:
            ready.get(timeout=120)
        t0 = time.monotonic()
        go.set()
        results = [out.get(timeout=3600) for _ in kids]
        wall = time.monotonic() - t0
    finally:
        for k in kids:
            k.join(timeout=10)
            if k.is_alive():
                k.kill()
    sessions = []
    for rows, _ in results:
        for ttft, gaps, tokens, error in rows:
            s = Session.__new__(Session)
            s.ttft, s.gaps, s.tokens, s.error = ttft, gaps, tokens, error
            sessions.append(s)
    return sessions, wall, [cpu for _, cpu in results]
