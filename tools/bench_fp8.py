"""fp8 pages on one GPU: the holder's partial over FlashMLA's 656-byte rows against bf16 rows.

    python -m tools.bench_fp8 --out bench/results/fp8-kernels-h100.json

For rows 1…64 × heads 16/64/128 at k 2048 over a 256k-token pool: device µs per call (CUDA
graphs of 10 calls, median of 10) of FlashMLA's bf16 sparse kernel and Triton on bf16 rows, and
of FlashMLA's fp8 sparse decode and the Triton fp8 kernel on the same rows quantized; and each
fp8 kernel's error against the fp8 torch reference. It prints a table and writes JSON; "auto"
picks FlashMLA for fp8 pools (``corpusd.kernels.registry``), which this measures.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import torch

from corpusd.kernels import fp8_cache as f8
from tools.gpu_timing import (
    D_V,
    D,
    K,
    command,
    env_info,
    graph_us,
    med,
    random_pool,
    random_request,
    save,
)


def run(pool_tokens: int, quick: bool) -> dict[str, Any]:
    from corpusd.kernels.registry import REGISTRY

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    bf16 = random_pool(pool_tokens, dev, seed=5)
    fp8 = f8.quantize(bf16)
    g = torch.Generator(device=dev).manual_seed(6)
    kinds = {
        "flashmla_bf16": (REGISTRY["flashmla"].fn, bf16),
        "triton_bf16": (REGISTRY["triton"].fn, bf16),
        "flashmla_fp8": (REGISTRY["flashmla"].fn, fp8),
        "triton_fp8": (REGISTRY["triton"].fn, fp8),
    }
    points = []
    print(f"{'rows':>5} {'heads':>5} " + " ".join(f"{k:>14}" for k in kinds) + "  (µs)")
    for h in (16, 64, 128):
        for rows in (1, 4, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64):
            q, idx = random_request(g, rows, h, K, pool_tokens, dev)
            t = {name: med(graph_us(partial(fn, q, kv, idx, D**-0.5, D_V))) for name, (fn, kv) in
                 kinds.items()}  # fmt: skip
            ro, rl = f8.fp8_partial_attention(q.float(), fp8, idx, D**-0.5, D_V)
            err = {}
            for name in ("flashmla_fp8", "triton_fp8"):
                fn, kv = kinds[name]
                o, lse = fn(q, kv, idx, D**-0.5, D_V)
                err[name] = {
                    "o_rel": float((o.float() - ro).norm() / ro.norm()),
                    "lse_abs": float((lse - rl).abs().max()),
                }
            points.append({"rows": rows, "heads": h, "us": t, "err": err})
            print(f"{rows:>5} {h:>5} " + " ".join(f"{v:>14.1f}" for v in t.values()), flush=True)
    return {"k": K, "pool_tokens": pool_tokens, "points": points}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/fp8-kernels.json"))
    ap.add_argument("--pool-tokens", type=int, default=1 << 18)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    a = ap.parse_args(argv)
    dev = torch.device("cuda", 0)
    result = {"command": command().replace("bench_gpu", "bench_fp8"), "env": env_info(dev)}
    result["fp8"] = run(a.pool_tokens, a.quick)
    save(a.out, result)


if __name__ == "__main__":
    main()
