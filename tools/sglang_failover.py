"""A holder SIGKILLed while a live SGLang server decodes through it on the device path (issue
35, item 5; ``tests/sglang/test_sglang_device_failover.py`` asserts on its JSON).

One GPU: a coordinator and two holders on it, one corpus (Python's standard library source)
pinned with two replicas of every page, an SGLang route server with the plugin and CUDA graphs
(the device path). Then ``--streams`` concurrent greedy streams, each the corpus plus its own
question, four times:

- ``reference``, ``floor`` and ``floor2``: uninterrupted; the floors' agreement with the
  reference is the noise floor (two runs of one batch differ where the batch's composition,
  which depends on when each request arrived, changes its arithmetic);
- ``killed``: the holder serving most pages' first replicas (the copy the device path reads) is
  SIGKILLed once the streams have ``--kill-after`` tokens among them (default: a twentieth), so
  the decode goes on well past the health checks that find it dead;
- ``after``: once the coordinator has dropped the dead holder (or ``--settle-s`` passed), the
  same streams again: the server still serves, corpora re-read from the page table included.

The JSON gives per run the failed requests, the tokens against ``reference``, and the longest
gap between two streamed tokens of any stream after the kill beside the median gap before it;
and the plugin's failover counters (``/metrics``).

    python -m tools.sglang_failover --out bench/results/sglang-failover-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from corpusd.testing.span_qa import stdlib_corpus
from corpusd.tokenizer import ByteTokenizer
from tools.sglang_server import Corpusd, Server, request, start_corpusd, stream_chunks

CORPUS = "stdlib"
METRICS = ("corpusd_requester_fallbacks_total", "corpusd_requester_sglang_failed_holders_total",
           "corpusd_requester_sglang_failover_pages_total")  # fmt: skip


def streams(
    server: Server, prompts: list[list[int]], new: int, vocab: int, tag: str,
    kill: tuple[int, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """All ``prompts`` streamed at once; ``kill``: (tokens, callable) calls it once that many
    tokens have arrived among them. Returns each stream's tokens (None: failed), its chunk
    times, the errors, and when the callable ran."""
    times: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int] | None] = [None] * len(prompts)
    errors: list[str] = []
    seen = [0]
    lock = threading.Lock()
    killed_at: list[float] = []

    def one(i: int) -> None:
        body = request(prompts[i], new, "route", CORPUS, i, vocab, False, tag)
        try:
            for ids in stream_chunks(server.url, body, 300):
                now = time.monotonic()
                with lock:
                    seen[0] += len(ids) - len(tokens[i] or [])
                    tokens[i] = ids
                    times[i].append(now)
                    due = kill is not None and not killed_at and seen[0] >= kill[0]
                    if due:
                        killed_at.append(now)
                if due:
                    assert kill is not None
                    kill[1]()
        except Exception as e:  # a failed request is what this counts
            tokens[i] = None
            with lock:
                errors.append(f"stream {i}: {type(e).__name__}: {e}"[:400])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    complete = [t for t in tokens if t is not None and len(t) == new]
    return {"tokens": tokens, "times": times, "errors": errors, "complete": len(complete),
            "killed_at": killed_at[0] if killed_at else None}  # fmt: skip


def gaps(run: dict[str, Any]) -> dict[str, Any]:
    """The longest gap between two chunks of any stream after the kill, and the median gap
    before it (seconds)."""
    k = run["killed_at"]
    before: list[float] = []
    after: list[float] = []
    for ts in run["times"]:
        for a, b in itertools.pairwise(ts):
            (after if b > k else before).append(b - a)
    return {
        "median_gap_before_s": round(statistics.median(before), 4) if before else None,
        "max_gap_after_kill_s": round(max(after), 4) if after else None,
        "gaps_after_kill": len(after),
    }


def same(a: list[Any], b: list[Any]) -> int:
    return sum(x is not None and x == y for x, y in zip(a, b, strict=True))


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(METRICS):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def first_replicas(cd: Corpusd) -> dict[str, int]:
    """Holder address → how many of the corpus's pages have their first replica there (the
    copy the device path reads while its holder lives)."""
    from corpusd.coordinator.client import CoordinatorClient

    async def table() -> dict[str, int]:
        async with CoordinatorClient(cd.coordinator) as c:
            (s,) = [s for s in await c.list_corpora() if s.name == CORPUS]
            t = await c.page_table(s.corpus_id)
            out: dict[str, int] = {}
            for reps in t.pages:
                out[t.address(reps[0][0])] = out.get(t.address(reps[0][0]), 0) + 1
            return out

    return asyncio.run(table())


def victim(cd: Corpusd) -> Any:
    """The holder daemon that serves the most pages' first replicas: its death moves pages."""
    firsts = first_replicas(cd)
    address = max(firsts, key=lambda a: firsts[a])
    return next(d for d in cd.daemons if d.address == address)


def common_prefix(a: list[int] | None, b: list[int] | None) -> int:
    if a is None or b is None:
        return 0
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def gone(cd: Corpusd, address: str, timeout: float) -> float:
    """Seconds until the coordinator lists no holder at ``address`` (``timeout`` if never)."""
    from corpusd.coordinator.client import CoordinatorClient

    async def listed() -> bool:
        async with CoordinatorClient(cd.coordinator) as c:
            return any(h.info.address == address for h in await c.list_holders())

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and asyncio.run(listed()):
        time.sleep(0.5)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/sglang-failover")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="", help="default: the sglang preset, initialised in --work")
    ap.add_argument("--corpus-bytes", type=int, default=8192)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024, help="new tokens per stream")
    ap.add_argument("--kill-after", type=int, default=0, help="default: a twentieth of all tokens")
    ap.add_argument("--settle-s", type=float, default=40.0)
    ap.add_argument("--port", type=int, default=30150)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else work / "model"
    if not (model / "config.json").exists():
        init = [sys.executable, "-m", "corpusd", "model", "init", str(model), "--preset", "sglang"]
        subprocess.run([*init, "--index-topk", "2048", "--index-arith", "fp8"], check=True)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    src = stdlib_corpus(work / "src", a.corpus_bytes)
    cd = start_corpusd(work, model, {CORPUS: (a.corpus_bytes, "")}, 2, a.device, "plain",
                       sources={CORPUS: src}, replicas=2)  # fmt: skip
    command = "python -m tools.sglang_failover " + " ".join(argv or sys.argv[1:])
    out: dict[str, Any] = {"command": command,
                           "streams": a.streams, "tokens_each": a.tokens, "holders": 2,
                           "replicas": 2, "corpus_tokens": len(cd.tokens[CORPUS])}  # fmt: skip
    try:
        out["holder_residency"] = cd.residency(model, "plain", a.device)
        port = a.port
        env = {"CORPUSD_SGLANG_METRICS_PORT": str(port + 1), "CORPUSD_SGLANG_PATH": "device"}
        server = Server("route", model, port, cd, work / "sglang-route.log", (a.streams,),
                        extra_env=env)  # fmt: skip
        try:
            out["server_start_s"] = server.wait()
            tok = ByteTokenizer()
            prompts = [tok.encode(f"\n\nQ: What does line {i} of this corpus say?\nA:")
                       for i in range(a.streams)]  # fmt: skip
            streams(server, prompts, a.tokens, vocab, "warm")  # graphs, kernels: discarded
            runs: dict[str, dict[str, Any]] = {}
            runs["reference"] = streams(server, prompts, a.tokens, vocab, "ref")
            runs["floor"] = streams(server, prompts, a.tokens, vocab, "floor")
            runs["floor2"] = streams(server, prompts, a.tokens, vocab, "floor2")
            out["first_replicas"] = first_replicas(cd)
            dead = victim(cd)
            kill_after = a.kill_after or a.streams * a.tokens // 20
            sigkill = (kill_after, lambda: dead.proc.send_signal(signal.SIGKILL))
            runs["killed"] = streams(server, prompts, a.tokens, vocab, "kill", sigkill)
            out["killed_holder"] = dead.address
            murl = f"http://127.0.0.1:{port + 1}/metrics"
            out["metrics_after_killed_run"] = metrics(murl)  # failed over during the decode?
            out["coordinator_dropped_it_after_s"] = round(gone(cd, dead.address, a.settle_s), 1)
            runs["after"] = streams(server, prompts, a.tokens, vocab, "after")
            ref = runs["reference"]["tokens"]
            out["runs"] = {
                name: {"failed": len(r["errors"]), "errors": r["errors"][:4],
                       "complete": r["complete"], "same_as_reference": same(r["tokens"], ref),
                       "mean_common_prefix": round(statistics.mean(
                           common_prefix(t, u) for t, u in zip(r["tokens"], ref, strict=True)), 1),
                       "decode_s": round(max(max(t) for t in r["times"] if t)
                                         - min(min(t) for t in r["times"] if t), 3)}
                for name, r in runs.items()
            }  # fmt: skip
            out["killed_at_s_into_decode"] = round(
                runs["killed"]["killed_at"] - min(min(t) for t in runs["killed"]["times"] if t), 3
            )
            out["stall"] = gaps(runs["killed"])
            out["metrics"] = metrics(murl)
            with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
                out["server_alive"] = r.status == 200
        finally:
            server.stop()
            out["server_log_failover"] = [
                line[-300:] for line in server.log.read_text(errors="replace").splitlines()
                if re.search(r"fail(ed)? over|health checks", line)
            ][:12]  # fmt: skip
    finally:
        cd.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out.get(k) for k in ("runs", "stall", "metrics", "server_alive")},
                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
