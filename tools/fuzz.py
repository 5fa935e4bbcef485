"""Fuzz every gRPC service of corpusd: a coordinator, two holders and an agent worker on
loopback get ``--n`` requests drawn around valid ones (corpusd/testing/fuzzing.py: wrong shapes
and dtypes, NaN/inf, out-of-range and huge values, empty and oversized fields, unknown ids,
random bytes in tensors, truncated or garbled messages), ``--concurrency`` at a time.

    python -m tools.fuzz                    # 10,000 requests, seed 0
    python -m tools.fuzz --n 20000 --seed 3

Prints a table of status codes per RPC and writes bench/results/fuzz-cpu.json: the codes, the
failures (INTERNAL, UNKNOWN, a hang, a daemon gone: each with what was sent), whether every
daemon is still up, their RSS before and after, and whether a normal session afterwards decodes
the same tokens as before the fuzzing. Exits 1 on any failure (RSS growth is reported, not
judged: see docs/testing.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from corpusd.model.tiny import init_tiny
from corpusd.testing.fuzzing import FuzzCluster, Fuzzer, decode, fuzz_cluster

OUT = Path("bench/results/fuzz-cpu.json")
PROMPT = list(b"\nQ: what is on line 12?")
NEW = 8
WARMUP = 1000  # requests before the first RSS reading: imports, caches and pools fill first
SETTLE_S = 3.0  # RSS is read idle: no call in flight, no channel open


def run(
    cluster: FuzzCluster, n: int, seed: int, concurrency: int, only: frozenset[str]
) -> dict[str, object]:
    ctx = cluster.ctx
    before_tokens = asyncio.run(decode(cluster.agent.address, ctx.corpus_id, PROMPT, NEW))

    async def fuzz(count: int, seed: int, report: bool) -> Fuzzer:
        f = Fuzzer(ctx, cluster.addresses, seed, only)
        step = max(1, count // 10)
        while f.tally.total < count:
            await f.run(min(step, count - f.tally.total), concurrency)
            if report:
                print(
                    f"{f.tally.total:>7,} requests  {f.tally.seconds:7.1f} s  failures "
                    f"{len(f.tally.failures)}  alive {all(cluster.alive().values())}  RSS MiB "
                    f"{ {k: v >> 10 for k, v in cluster.rss_kib().items()} }",
                    flush=True,
                )
        await f.close()  # the connections go too: RSS is read with no call or channel open
        await asyncio.sleep(SETTLE_S)
        return f

    warm = asyncio.run(fuzz(WARMUP, seed + 10_000, False))
    rss0 = cluster.rss_kib()
    print(f"warm-up: {warm.tally.total} requests ({len(warm.tally.failures)} failures), RSS {rss0}")
    fuzzer = asyncio.run(fuzz(n, seed, True))
    tally = fuzzer.tally
    tally.failures += warm.tally.failures
    alive = cluster.alive()
    rss1 = cluster.rss_kib()
    after_tokens = asyncio.run(decode(cluster.agent.address, ctx.corpus_id, PROMPT, NEW))
    growth = {k: round(rss1.get(k, 0) / rss0[k] - 1, 4) for k in rss0}
    print(tally.table())
    print(f"{tally.total:,} requests in {tally.seconds:.1f} s; kinds {dict(tally.kinds)}")
    print(f"daemons alive: {alive}; RSS growth after warm-up: {growth}")
    print(f"tokens before {before_tokens}, after {after_tokens}")
    for f in tally.failures[:20]:
        print("FAILURE", *f)
    return {
        "requests": tally.total,
        "seconds": round(tally.seconds, 1),
        "seed": seed,
        "concurrency": concurrency,
        "kinds": dict(tally.kinds),
        "codes_by_rpc": {
            rpc: {c: n for (r, c), n in sorted(tally.codes.items()) if r == rpc}
            for rpc in sorted({r for r, _ in tally.codes})
        },
        "codes": dict(sorted(tally.by_code().items())),
        "failures": [
            {"rpc": r, "kind": k, "code": c, "detail": d} for r, k, c, d in tally.failures
        ],
        "daemons_alive": alive,
        "rss_kib_after_warmup": rss0,
        "rss_kib_after": rss1,
        "rss_growth": growth,
        "decode_before": before_tokens,
        "decode_after": after_tokens,
        "warmup_requests": warm.tally.total,
        "ok": not tally.failures and all(alive.values()) and before_tokens == after_tokens,
        "rss_growth_under_10pct": max(growth.values()) < 0.10,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="requests to send")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--only", default="", help="RPCs or services to fuzz, comma-separated (default: all)"
    )
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it (daemon logs)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        tmp = a.keep or Path(d)
        model = init_tiny(tmp / "model", preset="sglang")  # as fuzz-cpu.json was measured
        with fuzz_cluster(tmp, model) as cluster:
            result = run(cluster, a.n, a.seed, a.concurrency, frozenset(a.only.split(",")) - {""})
    result = {
        "what": "tools/fuzz.py: requests drawn around valid ones to a coordinator, 2 holders and "
        "an agent worker (tiny model, CPU, loopback); every answer's status counted",
        "command": "python -m tools.fuzz " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "wall_seconds": round(time.monotonic() - t0, 1),
        **result,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}; ok={result['ok']}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
