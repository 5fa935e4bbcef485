"""A stand-in for ``python -m sglang.launch_server`` on a CPU machine: the HTTP surface
``tools/pin_sglang.py`` uses (``/health``, ``/server_info``, ``/flush_cache``, ``/generate``),
with SGLang 0.5.10's own limits and cache behaviour, so the timing code runs for real.

- The KV pool is ``min(--max-total-tokens, $FAKE_SGLANG_POOL)`` tokens; ``/generate`` refuses
  an input of ``>= min(context - 1, pool - 1) - 5`` tokens with 400, as SGLang's scheduler does.
- A prompt seen since the last ``/flush_cache`` comes back with ``cached_tokens`` = its length.
- A prefill takes ``$FAKE_SGLANG_S_PER_TOKEN`` × the uncached tokens (sleep), or the next of the
  comma-separated seconds in ``$FAKE_SGLANG_SLEEPS`` while any are left.
- Every request is appended to ``$FAKE_SGLANG_TRACE`` (JSON lines: path, tokens, first ids).

Run as ``sglang/launch_server.py`` on ``PYTHONPATH`` by :func:`install`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def install(root: Path) -> Path:
    """Write ``root/sglang/launch_server.py`` that runs :func:`main`; put ``root`` first on
    ``PYTHONPATH`` (with this repository) to make ``python -m sglang.launch_server`` this fake."""
    pkg = root / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "from tests.support.fake_sglang import main\n\nif __name__ == '__main__':\n    main()\n"
    )
    return root


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--context-length", type=int, required=True)
    ap.add_argument("--max-total-tokens", type=int, required=True)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    a, _ = ap.parse_known_args(argv)
    pool = min(a.max_total_tokens, int(os.environ.get("FAKE_SGLANG_POOL", 1 << 30)))
    limit = min(a.context_length - 1, pool - 1) - 5
    sleeps = [float(s) for s in os.environ.get("FAKE_SGLANG_SLEEPS", "").split(",") if s]
    per_token = float(os.environ.get("FAKE_SGLANG_S_PER_TOKEN", "0"))
    trace = os.environ.get("FAKE_SGLANG_TRACE")
    cached: set[tuple[int, ...]] = set()
    info = {
        "version": "fake-0.5.10.post1", "context_length": a.context_length,
        "chunked_prefill_size": a.chunked_prefill_size, "max_total_num_tokens": pool,
        "max_req_input_len": limit, "kv_cache_dtype": "bfloat16",
    }  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def reply(self, code: int, body: Any) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def record(self, entry: dict[str, Any]) -> None:
            if trace:
                with open(trace, "a") as f:
                    f.write(json.dumps({"path": self.path, **entry}) + "\n")

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200, "")
            elif self.path == "/server_info":
                self.reply(200, info)
            else:
                self.reply(404, "no such path")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/flush_cache":
                cached.clear()
                self.record({})
                self.reply(200, "Cache flushed.\n")
                return
            if self.path != "/generate":
                self.reply(404, "no such path")
                return
            req = json.loads(body)
            ids = tuple(req["input_ids"])
            self.record(
                {"tokens": len(ids), "head": list(ids[:4]), "sampling": req["sampling_params"]}
            )
            if len(ids) >= limit:
                self.reply(400, {"error": f"Input length ({len(ids)} tokens) exceeds {limit}"})
                return
            hit = len(ids) if ids in cached else 0
            time.sleep(sleeps.pop(0) if sleeps else per_token * (len(ids) - hit))
            cached.add(ids)
            meta = {"prompt_tokens": len(ids), "cached_tokens": hit, "e2e_latency": 0.001}
            self.reply(200, {"output_ids": [7], "meta_info": meta})

    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    print(f"fake sglang on {a.port}: context {a.context_length}, pool {pool}", file=sys.stderr)
    server.serve_forever()
