"""Index scores (the pin's indexer) on a GPU: Triton's fused kernel against the torch reference,
and top-k of the scores, at a prefill chunk's shape: TFLOP/s against the bf16 tensor-core peak.

    python -m tools.bench_index_scores --rows 1024 --heads 64 --dim 128 --keys 16384 65536 262144
Writes bench/results/index-scores-<gpu>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

from indexer import index_scores, select_topk
from indexer.triton_scores import triton_index_scores
from tools.gpu_timing import device_ms

#: dense bf16 tensor-core peak (TFLOP/s), from the vendors' data sheets; fp8 is twice it
PEAK_BF16 = {"h100": 989.0, "h200": 989.0}


def timed(fn: Any, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up (CUDA events)."""
    return statistics.median(device_ms(fn, reps, warmup=1))


def measure(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k: int, reps: int) -> dict:
    n, heads, dim = q.shape
    t = keys.shape[0]
    scale = dim**-0.5
    flop = 2.0 * n * heads * dim * t
    row: dict[str, Any] = {"keys": t, "gflop": round(flop / 1e9, 1)}
    for arith in ("exact", "fp8"):
        ms = timed(partial(triton_index_scores, q, w, keys, scale, arith), reps)
        row[f"triton_{arith}_ms"] = round(ms, 3)
        row[f"triton_{arith}_tflops"] = round(flop / ms / 1e9, 1)
    row["torch_exact_ms"] = round(timed(partial(index_scores, q, w, keys, scale), reps), 3)
    limit = torch.arange(t - n, t, device=q.device) + 1  # the last chunk of a causal prefill
    scores = triton_index_scores(q, w, keys, scale, limit=limit)  # masked, as the pin's are
    row["topk_ms"] = round(timed(partial(select_topk, scores, k), reps), 3)
    row["torch_topk_ms"] = round(timed(partial(torch.topk, scores, k + 1, dim=1), reps), 3)
    return row


def sweep(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, reps: int, arith: str = "exact"
) -> list[dict]:
    """Median ms of every launch config in the grid in ``arith``, fastest first."""
    flop = 2.0 * q.shape[0] * q.shape[1] * q.shape[2] * keys.shape[0]
    out = []
    for m, warps, stages, bt in itertools.product((128, 256), (4, 8), (3, 4), (64, 128, 256)):
        cfg = {"m": m, "warps": warps, "stages": stages}
        fn = partial(triton_index_scores, q, w, keys, q.shape[2] ** -0.5, arith, bt, cfg)
        try:
            ms = timed(fn, reps)
        except Exception as e:  # a config the compiler refuses (shared memory): say which
            out.append({**cfg, "block_t": bt, "error": str(e)[:200]})
            continue
        tflops = round(flop / ms / 1e9, 1)
        out.append({**cfg, "block_t": bt, "arith": arith, "ms": round(ms, 3), "tflops": tflops})
    return sorted(out, key=lambda r: r.get("ms", float("inf")))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--keys", type=int, nargs="+", default=[16384, 65536, 262144])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", type=int, default=0, help="also time launch configs at N keys")
    p.add_argument("--sweep-arith", choices=("exact", "fp8"), default="exact")
    p.add_argument("--out")
    a = p.parse_args()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev).lower()
    gpu = next((g for g in PEAK_BF16 if g in name), "gpu")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(a.rows, a.heads, a.dim, generator=g, device=dev).bfloat16()
    w = torch.randn(a.rows, a.heads, generator=g, device=dev) / a.heads**0.5
    rows = []
    for t in a.keys:
        keys = torch.randn(t, a.dim, generator=g, device=dev).bfloat16()
        rows.append(measure(q, w, keys, a.topk, a.reps))
        print(json.dumps(rows[-1]), file=sys.stderr)
    configs = []
    if a.sweep:
        keys = torch.randn(a.sweep, a.dim, generator=g, device=dev).bfloat16()
        configs = sweep(q, w, keys, 3, a.sweep_arith)
        for c in configs[:8]:
            print(json.dumps(c))
    result = {
        "what": "index scores of one prefill chunk: Triton fused kernel vs torch; top-k of them",
        "command": "python -m tools.bench_index_scores " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "shape": {"rows": a.rows, "heads": a.heads, "dim": a.dim, "topk": a.topk},
        "peak_bf16_tflops": PEAK_BF16.get(gpu),
        "peak_fp8_tflops": 2 * PEAK_BF16[gpu] if gpu in PEAK_BF16 else None,
        "rows": rows,
        "sweep": configs,
    }
    head = ("keys", "triton ms", "TFLOP/s", "fp8 ms", "TFLOP/s", "torch ms", "top-k ms")
    print(" ".join(f"{h:>9}" for h in head))
    for r in rows:
        cells = [r["keys"], r["triton_exact_ms"], r["triton_exact_tflops"], r["triton_fp8_ms"]]
        cells += [r["triton_fp8_tflops"]]
        cells += [r["torch_exact_ms"], r["topk_ms"]]
        print(" ".join(f"{c:>9}" for c in cells))
    out = Path(a.out or f"bench/results/index-scores-{gpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
