"""Random DeepSeek-V3.2 configs end to end, more of them than CI's property test
(tests/procs/test_model_configs.py): each seed's config is saved by transformers, loaded and
pinned by corpusd and decoded through two real holder processes, and its tokens compared with
transformers' ``generate``, then decoded again with one holder SIGKILLed mid-decode (the same
tokens required); a config corpusd cannot serve must be refused at load naming the field.

    python -m tools.config_sweep               # seeds 0..99
    python -m tools.config_sweep --n 40 --first 100
Prints one line per config and writes bench/results/config-sweep-cpu.json (each seed, its
config overrides over corpusd/testing/hf_checkpoints.BASE, and its result: ok, refused with the
message, mismatch with details, or error). Needs the test extras (transformers is the oracle).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from corpusd.testing.config_runs import (
    CORPUS_TOKENS,
    HOLDERS,
    KILL_AT,
    NEW_TOKENS,
    SUFFIXES,
    run_config,
)
from corpusd.testing.hf_checkpoints import BASE, draw_config

OUT = Path("bench/results/config-sweep-cpu.json")


def verdict(r_status: str, refused_field: str | None, detail: str) -> bool:
    """Whether a result is what corpusd promises: served and equal, or refused naming the field."""
    if refused_field is not None:
        return r_status == "refused" and refused_field in detail and "\n" not in detail
    return r_status == "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="configs to draw")
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--no-failover",
        action="store_true",
        help="skip the second decode of each served config with holder 0 SIGKILLed at step "
        f"{KILL_AT} (same tokens required)",
    )
    a = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    results = []
    t0 = time.monotonic()
    for seed in range(a.first, a.first + a.n):
        drawn = draw_config(seed)
        with tempfile.TemporaryDirectory() as d:
            r = run_config(Path(d), drawn, failover=not a.no_failover)
        row = r.to_json() | {"as_promised": verdict(r.status, r.refused_field, r.detail)}
        results.append(row)
        o = drawn.overrides
        print(
            f"seed {seed:4d}  {r.status:8s} {r.seconds:6.1f}s  heads {o['num_attention_heads']:3d} "
            f"layers {o['num_hidden_layers']} topk {o['index_topk']:4d} {r.indexer:11s} "
            f"{r.detail[:90]}",
            flush=True,
        )
    counts = Counter(r["status"] for r in results)
    broken = [r["seed"] for r in results if not r["as_promised"]]
    summary = dict(counts) | {"not_as_promised": broken, "seconds": round(time.monotonic() - t0)}
    print(json.dumps(summary))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "what": "random DeepSeek-V3.2 configs: transformers save -> corpusd load/pin -> "
                f"{HOLDERS} holder processes -> Worker decode (route) vs transformers generate"
                + ("" if a.no_failover else f", then again with holder 0 killed at step {KILL_AT}"),
                "command": f"python -m tools.config_sweep --n {a.n} --first {a.first}"
                + (" --no-failover" if a.no_failover else ""),
                "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
                "corpus_tokens": CORPUS_TOKENS,
                "suffixes": SUFFIXES,
                "new_tokens": NEW_TOKENS,
                "base": BASE,
                "summary": summary,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
