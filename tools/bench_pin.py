"""Pin throughput and peak RSS of the tiny model at several corpus sizes, on this CPU.

Each size runs in a fresh subprocess (so peak RSS is its own): a corpus directory of real
source text (this Python's standard library, in sorted order) cut to the target token count is
pinned into a temporary store. Next to the measured rate it prints the FLOP model of the pin
(indexer + attention + projections) and this machine's fp32 matmul rate measured in the same
run, so the table says how far from the compute floor the pin runs.

    python -m tools.bench_pin                  # 4k, 16k, 64k tokens
    python -m tools.bench_pin --sizes 4096     # one size
Writes bench/results/pin-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from corpusd.model import ModelConfig


def matmul_gflops() -> float:
    """fp32 GEMM rate at the indexer's shape ([n·H_I, 128] @ [128, 1024]), median of 9."""
    a, b = torch.randn(16384, 128), torch.randn(128, 1024)
    out = torch.empty(16384, 1024)
    times = []
    for _ in range(12):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t)
    times = sorted(times[3:])
    return 2 * 16384 * 128 * 1024 / times[len(times) // 2] / 1e9


def make_corpus(root: Path, tokens: int) -> None:
    """Copy stdlib ``*.py`` files (sorted) until their bytes (= byte tokens) reach ``tokens``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for f in sorted(stdlib.glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        data = text.encode()
        budget = tokens - total - len(f"### file: {f.name}\n") - 2
        if budget <= 0:
            break
        data = data[:budget].decode("utf-8", errors="ignore").encode()
        (root / f.name).write_bytes(data)
        total += len(data) + len(f"### file: {f.name}\n") + 1


def flop_model(cfg: ModelConfig, t: int, chunk: int) -> dict[str, float]:
    """FLOPs of pinning ``t`` tokens the way forward_tokens does (chunked, sparse)."""
    pairs = 0
    for start in range(0, t, chunk):
        n = min(chunk, t - start)
        if start + n > cfg.index_topk:
            pairs += n * (start + n)
    layers = cfg.num_hidden_layers
    indexer = 2.0 * pairs * cfg.index_n_heads * cfg.index_head_dim * layers
    attn = 2.0 * t * cfg.num_attention_heads * cfg.index_topk * (cfg.kv_dim + cfg.kv_lora_rank)
    return {"indexer": indexer, "attention": attn * layers}


def run_one(tokens: int, chunk: int) -> dict[str, object]:
    from corpusd.corpus.pin import PinConfig, pin

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        make_corpus(src, tokens)
        model = os.environ["BENCH_MODEL"]
        with open(os.devnull, "w") as quiet:
            r = pin(
                PinConfig(corpus=str(src), model=model, store=f"{tmp}/store", chunk=chunk), quiet
            )
        m = r.manifest
        flops = flop_model(ModelConfig.from_dir(model), m.token_count, chunk)
        return {
            "tokens": m.token_count,
            "prefill_s": m.prefill_seconds,
            "pin_s": round(r.seconds, 3),
            "tok_per_s": round(m.token_count / m.prefill_seconds, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "indexer_gflop": round(flops["indexer"] / 1e9, 1),
            "attention_gflop": round(flops["attention"] / 1e9, 1),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--out", default="bench/results/pin-cpu.json")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.chunk)))
        return
    from corpusd.model.tiny import init_tiny

    with tempfile.TemporaryDirectory() as model_dir:
        init_tiny(model_dir)
        gflops = matmul_gflops()
        rows = []
        for size in a.sizes:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tools.bench_pin",
                    "--one",
                    str(size),
                    "--chunk",
                    str(a.chunk),
                ],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "BENCH_MODEL": model_dir},
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            floor = (row["indexer_gflop"] + row["attention_gflop"]) / gflops
            row["compute_floor_s"] = round(floor, 2)
            row["of_floor"] = round(floor / row["prefill_s"], 2)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    cpu = platform.processor() or platform.machine()
    print(f"\nmatmul fp32: {gflops:.1f} GFLOP/s on {os.cpu_count()} cores ({cpu})")
    head = (
        "tokens",
        "prefill s",
        "tok/s",
        "peak RSS",
        "indexer GF",
        "attn GF",
        "floor s",
        "floor/act",
    )
    print(" ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            f"{r['tokens']:,}",
            f"{r['prefill_s']:.1f}",
            f"{r['tok_per_s']:,.0f}",
            f"{r['peak_rss_mib']:,.0f}Mi",
            f"{r['indexer_gflop']:,.0f}",
            f"{r['attention_gflop']:,.0f}",
            f"{r['compute_floor_s']:.1f}",
            f"{r['of_floor']:.2f}",
        )
        print(" ".join(f"{c:>10}" for c in cells))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "what": "corpusd pin, tiny model, CPU, fp32 cache; tok/s = tokens / prefill s",
                "command": "python -m tools.bench_pin " + " ".join(sys.argv[1:]),
                "machine": {
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                },
                "matmul_fp32_gflops": round(gflops, 1),
                "chunk": a.chunk,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
