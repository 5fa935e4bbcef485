"""How many streamed tokens a second ``tools/bench_share.py``'s load generator takes in, per
process: the ceiling under which its closed loop measures the servers and above which it
measures itself.

A stand-in for SGLang's ``/generate`` (:class:`FakeGenerate`, in processes of its own) streams
every session's tokens as fast as it can write them, one server-sent event per token with the
cumulative ``output_ids`` and a ``meta_info`` as SGLang's are, and counts them in
``sglang:generation_tokens_total`` on ``/metrics``. The bench's own :func:`tools.bench_share.trial`
then runs its clients against it with the load dealt over 1, 2, … processes. Reported per
process count: tokens/s, and the load generator's CPU microseconds per token (the GIL's work on
each chunk: HTTP chunked decoding, a line, a JSON parse), which does not depend on how fast the
stand-in writes::

    python -m tools.bench_client_cap --procs 1,2 --clients 64 --out /tmp/client-cap.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tools.bench_share import trial


class FakeGenerate(ThreadingHTTPServer):
    """SGLang's ``/generate`` stream and ``/metrics`` counters, with no model: each request
    gets ``max_new_tokens`` events at once."""

    daemon_threads = True
    request_queue_size = 1024  # every client connects at once (the default backlog is 5)

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.lock = threading.Lock()
        self.tokens = 0
        self.running = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeGenerate

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        with self.server.lock:
            tokens, running = self.server.tokens, self.server.running
        body = (
            f'sglang:generation_tokens_total{{model_name="fake"}} {tokens}\n'
            f'sglang:num_running_reqs{{model_name="fake"}} {running}\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(req["sampling_params"]["max_new_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with self.server.lock:
            self.server.running += 1
        try:
            ids: list[int] = []
            for i in range(n):
                ids.append(1000 + i)
                done = {"type": "length", "length": n} if i == n - 1 else None
                meta = {
                    "id": "0123456789abcdef0123456789abcdef",
                    "finish_reason": done,
                    "prompt_tokens": len(req["input_ids"]),
                    "weight_version": "default",
                    "completion_tokens": i + 1,
                    "cached_tokens": 0,
                    "e2e_latency": 0.001 * i,
                }
                ev = {"text": "", "output_ids": ids, "meta_info": meta, "index": 0}
                self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                with self.server.lock:
                    self.server.tokens += 1
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        finally:
            with self.server.lock:
                self.server.running -= 1

    def _chunk(self, b: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))


def _serve(port: int) -> None:
    FakeGenerate(port).serve_forever()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/metrics", timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class _At:
    """What :func:`tools.bench_share.trial` reads of a server: its URL."""

    def __init__(self, url: str) -> None:
        self.url = url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="1,2", help="load-generator processes to try")
    ap.add_argument("--servers", type=int, default=2, help="stand-in servers (processes)")
    ap.add_argument("--clients", type=int, default=64, help="clients per server")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per session")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    mp = multiprocessing.get_context("spawn")
    ports = [_free_port() for _ in range(a.servers)]
    servers = [mp.Process(target=_serve, args=(p,), daemon=True) for p in ports]
    for s in servers:
        s.start()
    at = [_At(f"http://127.0.0.1:{p}") for p in ports]
    for server in at:
        _wait_up(server.url)
    prompts = [list(range(64))]
    rows = []
    try:
        trial(at, "stock", "", prompts, 2, 8, 1)  # servers up, first connections
        for procs in (int(p) for p in a.procs.split(",")):
            runs = [
                trial(at, "stock", "", prompts, a.clients, a.tokens, 1, procs)
                for _ in range(a.trials + 1)
            ][1:]  # the first: warm-up
            row = {
                "procs": procs,
                "tokens_per_s": [round(r["tokens_per_s"]) for r in runs],
                "client_us_per_token": [
                    round(1e6 * r["client_cpu_s"] / r["client_tokens"], 1) for r in runs
                ],
                "client_busy_max": [round(r["client_busy_max"], 2) for r in runs],
                "errors": sum(r["errors"] for r in runs),
            }
            rows.append(row)
            print(
                f"procs {procs}: {statistics.median(row['tokens_per_s']):,.0f} tok/s "
                f"(trials {row['tokens_per_s']}), client "
                f"{statistics.median(row['client_us_per_token'])} µs a token, busiest "
                f"process {max(row['client_busy_max'])} of a core, errors {row['errors']}",
                flush=True,
            )
    finally:
        for s in servers:
            s.kill()
    out = {
        "what": "bench_share's load generator against stand-in SGLang servers that stream at once",
        "command": "python -m tools.bench_client_cap " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.python_version()}",
        "servers": a.servers,
        "clients_per_server": a.clients,
        "tokens_per_session": a.tokens,
        "rows": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
