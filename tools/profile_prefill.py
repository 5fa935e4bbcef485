"""Kernel-level profile of the GPU pin's prefill: which CUDA kernels its time goes to.

``tools/bench_pin.py --profile`` times the prefill's phases with a synchronise around each;
this records every kernel of an unsynchronised chunked prefill (``corpusd.corpus.pin``'s loop:
``forward_tokens`` per chunk) with ``torch.profiler`` and sums device time per kernel name.
The checkpoint is the ``sglang`` preset as ``bench_pin --sglang`` makes it (index_topk 2048,
index_arith fp8 unless ``--index-arith exact``); the tokens are random bytes, or with
``--text`` this Python's standard library source (sorted), as ``bench_pin``'s rows.

    python -m tools.profile_prefill --tokens 16384 131072 --out /tmp/prefill-profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from corpusd.corpus.pin import warm_up
from corpusd.model import KVCache, forward_tokens, load_model
from corpusd.model.prefill_kernels import choose
from corpusd.model.tiny import init_tiny


def run(model: torch.nn.Module, tokens: torch.Tensor, chunk: int, kernels: object) -> float:
    """One chunked prefill of ``tokens``; wall seconds."""
    cache = KVCache(model.cfg, len(tokens), torch.bfloat16, str(tokens.device))  # type: ignore[arg-type]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for start in range(0, len(tokens), chunk):
        forward_tokens(model, tokens[start : start + chunk], cache, False, kernels)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    return time.perf_counter() - t


def stdlib_bytes(n: int) -> bytes:
    """The first ``n`` bytes of this Python's standard library ``*.py`` files, sorted."""
    out = bytearray()
    for f in sorted(Path(os.__file__).parent.glob("*.py")):
        out += f.read_bytes()
        if len(out) >= n:
            break
    return bytes(out[:n])


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--index-arith", choices=("exact", "fp8"), default="fp8")
    p.add_argument("--top", type=int, default=14, help="kernels listed per size")
    p.add_argument("--text", action="store_true", help="stdlib source bytes, not random ones")
    p.add_argument("--out", default="/tmp/prefill-profile.json")
    a = p.parse_args()
    result: dict = {
        "command": "python -m tools.profile_prefill " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "sizes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        positions = max(163840, -(-max(a.tokens) // 4096) * 4096)
        model_dir = init_tiny(
            Path(tmp) / "m", preset="sglang", index_topk=2048, index_arith=a.index_arith,
            max_position_embeddings=positions,
        )  # fmt: skip
        model = load_model(model_dir, device="cuda", dtype=torch.bfloat16)
        kernels = choose(model.cfg, "cuda", torch.bfloat16)
        warm_up(model, kernels)
        g = torch.Generator().manual_seed(0)
        for n in a.tokens:
            tokens = torch.randint(2, 256, (n,), generator=g).cuda()
            if a.text:
                tokens = torch.tensor(list(stdlib_bytes(n)), dtype=torch.int64).cuda()
            first = run(model, tokens, a.chunk, kernels)  # the allocator grows here
            plain = run(model, tokens, a.chunk, kernels)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(model, tokens, a.chunk, kernels)
            rows = []
            for e in prof.key_averages():
                us = e.self_device_time_total
                if us > 0:
                    rows.append({"kernel": e.key[:90], "ms": round(us / 1e3, 2), "calls": e.count})
            rows.sort(key=lambda r: -r["ms"])
            total = sum(r["ms"] for r in rows)
            result["sizes"][str(n)] = {
                "first_wall_s": round(first, 4),
                "wall_s": round(plain, 4),
                "tok_per_s": round(n / plain),
                "kernel_ms_total": round(total, 1),
                "kernels": rows[:40],
            }
            print(f"{n:,} tokens: {plain:.3f} s wall ({n / plain:,.0f} tok/s; first run "
                  f"{first:.3f} s), {total:.0f} ms of kernels")  # fmt: skip
            for r in rows[: a.top]:
                share = 100 * r["ms"] / total
                print(f"  {r['ms']:9.2f} ms {share:5.1f} % {r['calls']:5d}  {r['kernel']}")
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
