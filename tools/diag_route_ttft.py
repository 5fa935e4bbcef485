"""Where route's first token goes when many requests arrive at once (issue 17).

``bench_sglang`` measured route's time to first token under 64 concurrent arrivals at 2.6–4.3×
stock's on an H100 while every other number was at or below stock's. This runs the same sparse
corpus and the same 64-stream bursts against stock and route, and keeps what the summary hides:

- every request's first-token time and, client side, when its request was sent;
- SGLang's prefill batches (``#new-seq``, new and cached tokens) from each server's log;
- on route, every bound prefill's host time, GPU time and wall time
  (``CORPUSD_SGLANG_PROFILE_SLOW=<threshold>``, which waits for each prefill: a diagnosis run,
  not a benchmark), with the host profile of each over the threshold.

    python -m tools.diag_route_ttft --out bench/results/route-ttft-h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from corpusd.tokenizer import ByteTokenizer
from tools.bench_sglang import QUESTIONS, REGIMES
from tools.sglang_server import Server, request, start_corpusd

PREFILL = re.compile(
    r"^\[(\S+ \S+)\] Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)"
)
SLOW = re.compile(r"bound prefill of (\d+) tokens \((\d+) requests\) held the host ([\d.]+) s, "
                  r"GPU ([\d.]+) ms, ([\d.]+) ms until done")  # fmt: skip


def burst(server: Server, mode: str, prompts: list[list[int]], streams: int, vocab: int,
          n_tokens: int) -> dict[str, Any]:  # fmt: skip
    """``streams`` streamed requests sent at once; per request: sent and first-token times
    (ms after the burst began) and its token count."""
    t0 = time.monotonic()

    def one(i: int) -> tuple[float, list[float]]:
        body = request(prompts[i % len(prompts)], n_tokens, mode, "sparse", 200 + i, vocab, False)
        sent = time.monotonic()
        times, _ = server.stream(body)
        return sent, times

    with ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(one, range(streams)))
    sent = [1e3 * (s - t0) for s, _ in got]
    first = [1e3 * (t[0] - t0) for _, t in got if t]
    last = [1e3 * (t[-1] - t0) for _, t in got if t]
    return {
        "sent_ms": sent, "first_token_ms": sorted(first), "last_token_ms": sorted(last),
        "ttft_p50_ms": statistics.median(first), "e2e_p50_ms": statistics.median(last),
    }  # fmt: skip


def log_facts(log: Path, since: int) -> dict[str, Any]:
    """Prefill batches and slow bound prefills in ``log`` after line ``since``."""
    lines = log.read_text(errors="replace").splitlines()[since:]
    batches = [
        {"at": m[1], "seqs": int(m[2]), "new": int(m[3]), "cached": int(m[4])}
        for m in map(PREFILL.match, lines) if m
    ]  # fmt: skip
    slow = [
        {"tokens": int(m[1]), "requests": int(m[2]), "host_s": float(m[3]),
         "gpu_ms": float(m[4]), "wall_ms": float(m[5])}
        for m in (SLOW.search(ln) for ln in lines) if m
    ]  # fmt: skip
    return {"prefill_batches": batches, "bound_prefills_over_threshold": slow}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/route-ttft.json")
    ap.add_argument("--work", default="/tmp/corpusd-diag-ttft")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threshold-s", default="0.02", help="CORPUSD_SGLANG_PROFILE_SLOW for route")
    ap.add_argument("--modes", default="stock,route")
    ap.add_argument("--port", type=int, default=30170)
    a = ap.parse_args(argv)
    work = Path(a.work)
    model = work / "model"
    if not (model / "config.json").exists():  # bench_sglang's model: tiny, index_topk 2048
        cmd = [sys.executable, "-m", "corpusd", "model", "init", str(model), "--preset", "sglang"]
        subprocess.run([*cmd, "--index-topk", "2048", "--index-arith", "fp8"], check=True)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    cd = start_corpusd(work, model, {"sparse": REGIMES["sparse"]}, 2, "cuda:0")
    corpus = cd.tokens["sparse"]
    suffixes = [ByteTokenizer().encode(f"\n\nQ: {q}\nA:") for q in QUESTIONS[:8]]
    out: dict[str, Any] = {"command": "python -m tools.diag_route_ttft " + " ".join(argv or
                           sys.argv[1:]), "corpus_tokens": len(corpus), "modes": {}}  # fmt: skip
    try:
        for mode in a.modes.split(","):
            if mode == "route":
                os.environ["CORPUSD_SGLANG_PROFILE_SLOW"] = a.threshold_s
            log = work / f"sglang-{mode}.log"
            server = Server(mode, model, a.port, cd, log, (8, a.streams))
            try:
                server.wait()
                prompts = suffixes if mode == "route" else [corpus + s for s in suffixes]
                burst(server, mode, prompts, 8, vocab, a.tokens)  # warm: the radix cache, shapes
                runs = []
                for _ in range(a.bursts):
                    since = len(log.read_text(errors="replace").splitlines())
                    r = burst(server, mode, prompts, a.streams, vocab, a.tokens)
                    time.sleep(0.5)  # the log's last lines
                    runs.append({**r, **log_facts(log, since)})
                    seqs = [b["seqs"] for b in runs[-1]["prefill_batches"]]
                    print(f"{mode}: ttft p50 {r['ttft_p50_ms']:.1f} ms, e2e p50 "
                          f"{r['e2e_p50_ms']:.1f} ms, prefill batches {seqs}",
                          flush=True)  # fmt: skip
                out["modes"][mode] = runs
            finally:
                server.stop()
            Path(a.out).write_text(json.dumps(out, indent=1))
    finally:
        cd.stop()
    for mode, runs in out["modes"].items():
        for r in runs:
            over = r["bound_prefills_over_threshold"]
            slow = [(s["tokens"], s["gpu_ms"], s["wall_ms"]) for s in over]
            print(f"{mode:<6} ttft p50 {r['ttft_p50_ms']:7.1f} ms  e2e p50 {r['e2e_p50_ms']:7.1f} "
                  f"ms  sent within {max(r['sent_ms']):5.1f} ms  bound prefills (tokens, GPU ms, "
                  f"wall ms): {slow}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
