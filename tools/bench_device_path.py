"""The SGLang plugin's corpus path per layer, timed on the device (issue 17).

One decode layer's corpus work as ``requester/sglang/backend.py`` runs it on the device path:
SGLang's fp8 indexer kernel over the corpus arena, the fused exact top-k with the request's own
logits, FlashMLA's sparse partial over a holder pool (in-process here; the server maps the
holder's by CUDA IPC, the same memory), and the LSE merge with the local partial. Each stage and
the whole step are captured in CUDA graphs and timed by CUDA events around replays (medians), at
the shapes of ``tools/bench_sglang.py``'s sparse regime (64 heads, top-2048, a 3,656-token
corpus), for several batch sizes. Needs sglang's kernels (deep_gemm, sgl_kernel): .sglang-deps/.

    python -m tools.bench_device_path --out bench/results/sglang-device-path-h100.json

``--kv-format fp8_e4m3`` times the same step over a pool of FlashMLA's fp8 rows (the partial is
then FlashMLA's fp8 sparse decode, ``corpusd/kernels/flashmla.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from corpusd.kernels import flashmla
from corpusd.kernels import fp8_cache as f8
from corpusd.kernels.flashmla import sparse_lse_base2
from requester.corpus_view import CorpusView
from requester.sglang import device, device_scores
from requester.sglang.lse import merge_local_corpus
from requester.sglang.resident import ArenaCorpus, Resident
from tools.gpu_timing import command


def graphed_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median device time (ms) of one replay of ``fn`` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(
    res: Resident, c: ArenaCorpus, n: int, a: argparse.Namespace, base2: bool
) -> dict[str, Any]:
    """Each stage and the whole step at ``n`` query rows, all bound to corpus ``c``."""
    dev, k, h = res.device, a.topk, a.heads
    slots = torch.arange(n, device=dev)
    res.bind(slots, [c] * n)
    q_fp8 = torch.randn(n, 64, 128, device=dev).to(torch.float8_e4m3fn)
    w = torch.rand(n, 64, device=dev)
    own = torch.randn(n, a.own_tokens, device=dev)
    own_len = torch.full((n,), a.own_tokens, device=dev)
    q = torch.randn(n, h, 576, device=dev).bfloat16()
    o_loc = torch.randn(n, h, 512, device=dev).bfloat16()
    l_loc = torch.randn(n, h, device=dev)
    base, tokens = res.rows_of(slots)
    scores = device_scores.corpus_scores(res, 0, q_fp8, w, base, tokens)
    corpus, _ = device.fused_topk(scores, tokens, own, own_len, k)
    o_c, l_c = device.corpus_partial(res, 0, q, corpus, base, 576**-0.5, 512, base2)

    def step() -> Any:
        b, tk = res.rows_of(slots)
        sc = device_scores.corpus_scores(res, 0, q_fp8, w, b, tk)
        cp, _ = device.fused_topk(sc, tk, own, own_len, k)
        oc, lc = device.corpus_partial(res, 0, q, cp, b, 576**-0.5, 512, base2)
        return merge_local_corpus(o_loc, l_loc, oc, lc)

    stages = {
        "scores": lambda: device_scores.corpus_scores(res, 0, q_fp8, w, base, tokens),
        "topk": lambda: device.fused_topk(scores, tokens, own, own_len, k),
        "partial": lambda: device.corpus_partial(res, 0, q, corpus, base, 576**-0.5, 512, base2),
        "merge": lambda: merge_local_corpus(o_loc, l_loc, o_c, l_c),
        "step": step,
    }
    if a.variants and res.kv_format == "plain":  # other top-k methods, kernel splits (bf16)
        cat = torch.cat([scores, own], 1)
        ok = torch.ones_like(cat, dtype=torch.bool)
        keys = device.order_keys(cat, ok)
        stages["topk_keys_only"] = lambda: device.order_keys(cat, ok)
        stages["topk_int64_unsorted"] = lambda: keys.topk(k, dim=1, sorted=False)
        stages["topk_int64_sort"] = lambda: keys.sort(dim=1, descending=True)
        stages["topk_f32_unsorted"] = lambda: cat.topk(k, dim=1, sorted=False)
        _, rows = device.corpus_rows(corpus, base, res.page_holder, res.page_frame, res.page_size)
        kv = res.pools[0][0]
        for sp in (1, 2, 4, 8, 16):
            stages[f"kernel_splits_{sp}"] = functools.partial(
                device.sparse_partial, q, kv, rows, 576**-0.5, 512, base2, sp
            )
        # the holders' own Triton kernel (flash-decoding: k split over programs, LSE merge)
        from corpusd.kernels.triton_mla import triton_partial_attention

        stages["kernel_triton"] = functools.partial(
            triton_partial_attention, q, kv, rows, 576**-0.5, 512
        )
    row: dict[str, Any] = {"rows": n}
    row.update({f"{s}_us": 1e3 * graphed_ms(f, a.reps) for s, f in stages.items()})
    # The partial's floor: it reads k latent rows (bf16, or 656-byte fp8 rows) per query row.
    row["partial_bytes"] = n * k * (656 if res.kv_format == "fp8_e4m3" else 576 * 2)
    return row


def run(a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    p, t, k, h = 64, a.corpus_tokens, a.topk, a.heads
    window = -(-t // 1024) * 1024
    res = Resident(
        n_layers=1, page_size=p, index_dim=128, arena_tokens=2 * window, window_tokens=window,
        device=dev, ue8m0=False, req_slots=max(a.batches),
    )  # fmt: skip
    frames = math.ceil(t / p) + 8
    pool = torch.randn(frames * p, 576, device=dev).bfloat16()
    res.add_pool("h0", [f8.quantize(pool) if a.kv_format == "fp8_e4m3" else pool])
    if a.kv_format == "fp8_e4m3":  # probed before any capture, as the entry model does
        flashmla.lse_to_natural(str(pool.device), fp8=True)
    n_pages = math.ceil(t / p)
    page_frame = torch.randperm(frames)[:n_pages]
    view = CorpusView(
        "c", t, p, ("h0",), torch.zeros(n_pages, dtype=torch.int64), page_frame,
        tuple(((0, int(f)),) for f in page_frame),  # the arena maps each page's first replica
    )  # fmt: skip
    c = res.load(view, [torch.randn(t, 128)])
    base2 = sparse_lse_base2("cuda")
    rows = []
    for n in a.batches:
        row = measure(res, c, n, a, base2)
        rows.append(row)
        print(
            f"rows {n:>3}: scores {row['scores_us']:6.1f}  top-k {row['topk_us']:6.1f}  "
            f"partial {row['partial_us']:6.1f}  merge {row['merge_us']:5.1f}  "
            f"step {row['step_us']:6.1f} µs",
            flush=True,
        )
        extra = {k: round(v, 1) for k, v in row.items() if k.startswith(("topk_", "kernel_"))}
        if extra:
            print(f"          {extra}", flush=True)
    return {
        "device": torch.cuda.get_device_name(),
        "corpus_tokens": t,
        "own_tokens": a.own_tokens,
        "topk": k,
        "heads": h,
        "holder_pools": 1,
        "kv_format": a.kv_format,
        "reps": a.reps,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/sglang-device-path.json")
    ap.add_argument("--corpus-tokens", type=int, default=3656)
    ap.add_argument("--own-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[8, 64])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variants", action="store_true", help="also time other top-k methods")
    ap.add_argument("--kv-format", choices=("plain", "fp8_e4m3"), default="plain",
                    help="the holder pool's rows: bf16, or FlashMLA's fp8 rows")  # fmt: skip
    a = ap.parse_args(argv)
    out = {"command": command(), **run(a)}  # run() names the device
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
