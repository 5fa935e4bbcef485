"""tools/sglang_failover.py's bookkeeping on CPU, against a stand-in for SGLang's streaming
/generate (no sglang needed): every stream's tokens and chunk times, the kill called once after
the given number of tokens, a stream that breaks counted as failed, and the stall read from the
chunk gaps around the kill."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tools.sglang_failover import common_prefix, gaps, same, streams


class _Generate(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        first = body["input_ids"][-1]
        self.send_response(200)
        self.end_headers()
        for k in range(1, n + 1):
            if first == 99 and k == 3:  # this stream breaks mid-way
                self.wfile.write(b'data: {"error": {"message": "boom"}}\n\n')
                return
            ids = [first + j for j in range(k)]
            self.wfile.write(f"data: {json.dumps({'output_ids': ids})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[SimpleNamespace]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Generate)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.shutdown()


def test_streams_count_tokens_kill_once_and_failures(server: SimpleNamespace) -> None:
    calls: list[float] = []
    prompts = [[1, 10], [1, 20], [1, 99]]
    run = streams(server, prompts, 6, 256, "t", (5, lambda: calls.append(time.monotonic())))  # type: ignore[arg-type]
    assert len(calls) == 1 and run["killed_at"] <= calls[0]
    assert run["tokens"][:2] == [[10 + j for j in range(6)], [20 + j for j in range(6)]]
    assert run["tokens"][2] is None and run["complete"] == 2
    assert len(run["errors"]) == 1 and "boom" in run["errors"][0]
    assert [len(t) for t in run["times"][:2]] == [6, 6]
    g = gaps(run)
    assert g["gaps_after_kill"] > 0 and 0.005 < g["max_gap_after_kill_s"] < 1.0
    assert same(run["tokens"], [[10 + j for j in range(6)], [0], None]) == 1


def test_gaps_split_at_the_kill() -> None:
    run = {"killed_at": 10.0, "times": [[9.0, 9.5, 10.0, 10.8, 11.0], [9.9, 10.3]]}
    assert gaps(run) == {"median_gap_before_s": 0.5, "max_gap_after_kill_s": 0.8,
                         "gaps_after_kill": 3}  # fmt: skip


def test_common_prefix_counts_equal_leading_tokens_and_a_failed_stream_as_none() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix(None, [1]) == 0
