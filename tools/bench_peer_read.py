"""The corpus partial over a holder pool on another GPU, read in place against staged (issue 35).

The SGLang plugin's device path reads a holder on another GPU of the host through peer access
(``cuda_p2p``): the pool is mapped onto the server's GPU and FlashMLA's sparse kernel reads the
selected rows across NVLink. ``bench_share --spread`` (4 × H200) measured a worker 3× slower per
decode step at 128 rows than with its corpus in its own HBM. This script times, on one GPU pair,
per layer, with CUDA graphs and events:

- ``local``: FlashMLA over a pool in this GPU's HBM (the floor);
- ``in_place``: the same rows of a pool on GPU 1, read in place (``CORPUSD_SGLANG_STAGE_ROWS=0``);
- ``staged/<c>``: every selected row copied into this GPU first, ``c`` query rows a copy, then
  FlashMLA over the copy (``device.staged_partial``);
- ``split_in_place`` and ``split_staged/<c>``: the rows spread over a local pool and the peer
  pool, as ``--spread`` places them: one kernel call per pool merged by LSE, against one copy
  and one call;
- ``two_call`` and ``one_call``: a whole decode layer with a tenth of the slots the request's own
  tokens, as the device path attends it (SGLang's call, the corpus call, the merge) and in one
  call over one staged buffer (``CORPUSD_SGLANG_ONE_CALL``);
- ``copy``: the staging copy alone, as GB/s over the link, beside the copy engine's
  ``Tensor.copy_`` of as many contiguous bytes (the link's floor here).

``--same-gpu`` puts both pools on GPU 0 (one GPU is enough): no link, so it checks the kernels
(staged equal to local) and measures the copy at HBM speed.

Each figure is the median of ``--trials`` trials (each the median of ``--reps`` replays of a
graph of 5 calls, after discarded warm-up replays), with min and max. Outputs are compared
with ``local``'s (max |Δ|).

    PYTHONPATH=.gpu-deps/site python -m tools.bench_peer_read --out bench/results/peer-read.json
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from corpusd.kernels.flashmla import sparse_lse_base2
from corpusd.transport.cuda_ipc import open_shared, share
from requester.sglang import device
from requester.sglang.lse import merge_local_corpus
from tools.gpu_timing import command, graph_us

D_QK, D_V = 576, 512


def _holder(conn: Any, tokens: int, gpu: int) -> None:
    """A pool on ``gpu``, exported; kept alive until the parent says so."""
    torch.cuda.set_device(gpu)
    g = torch.Generator(device=f"cuda:{gpu}").manual_seed(1)
    pool = torch.randn(tokens, D_QK, device=f"cuda:{gpu}", generator=g).bfloat16()
    conn.send(share(pool))
    conn.recv()


def trials(fn: Callable[[], Any], reps: int, n: int) -> dict[str, float]:
    """``n`` trials, each the median device time (µs) of a call of ``fn`` over ``reps`` replays
    of a CUDA graph of 5 calls (``gpu_timing.graph_us``: warm-up replays discarded)."""
    xs = [statistics.median(graph_us(fn, per_graph=5, reps=reps)) for _ in range(n)]
    return {"median_us": round(statistics.median(xs), 1), "min_us": round(min(xs), 1),
            "max_us": round(max(xs), 1)}  # fmt: skip


def run(a: argparse.Namespace) -> dict[str, Any]:
    torch.cuda.set_device(0)
    if a.same_gpu:  # the kernels and their copy's HBM bandwidth, no link
        g = torch.Generator(device="cuda:0").manual_seed(1)
        local = torch.randn(a.pool_tokens, D_QK, device="cuda:0", generator=g).bfloat16()
        return {**measure(a, local.clone(), local), "peer": "none: --same-gpu, both pools on GPU 0"}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, a.pool_tokens, 1), daemon=True)
    proc.start()
    try:
        peer = open_shared(parent.recv(), on=0)
        local = peer.clone()  # the same rows, in GPU 0's HBM
        torch.cuda.synchronize()
        return measure(a, peer, local)
    finally:
        parent.send("done")
        proc.join(timeout=30)


def measure(a: argparse.Namespace, peer: torch.Tensor, local: torch.Tensor) -> dict[str, Any]:
    base2 = sparse_lse_base2("cuda:0")
    scale = D_QK**-0.5
    g = torch.Generator(device="cuda:0").manual_seed(0)

    def partial(qq: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> Any:
        return device.sparse_partial(qq, kv, idx, scale, D_V, base2)

    out = []
    for n in a.rows:
        row = measure_rows(a, n, peer, local, partial, g)
        out.append(row)
        shown = {k_: v["median_us"] for k_, v in row.items() if isinstance(v, dict)}
        print(f"rows {n}: {shown}; copy {row['copy']['gb_s']} GB/s, "
              f"copy engine {row['copy_engine_contiguous']['gb_s']} GB/s", flush=True)  # fmt: skip
    return {
        "device": torch.cuda.get_device_name(0),
        "peer": "GPU 1's pool mapped onto GPU 0 (cuda_ipc.open_shared, peer access)",
        "pool_tokens": a.pool_tokens,
        "reps": a.reps,
        "trials": a.trials,
        "rows": out,
    }


def measure_rows(
    a: argparse.Namespace, n: int, peer: torch.Tensor, local: torch.Tensor,
    partial: device.Partial, g: torch.Generator,
) -> dict[str, Any]:  # fmt: skip
    """Every variant at ``n`` query rows, each selecting ``--topk`` random rows of the pool."""
    k, dev = a.topk, local.device
    q = torch.randn(n, a.heads, D_QK, device=dev, generator=g).bfloat16()
    rows = torch.randint(0, a.pool_tokens, (n, k), device=dev, generator=g).to(torch.int32)
    on_peer = torch.zeros(n, k, dtype=torch.int32, device=dev)
    split = torch.randint(0, 2, (n, k), device=dev, generator=g).to(torch.int32)
    ref_o, _ = partial(q, local, rows)

    def split_in_place() -> Any:
        o = torch.zeros(n, a.heads, D_V, device=dev)
        lse = device.empty_lse(n, a.heads, dev)
        for slot, pool in enumerate((local, peer)):
            o_s, l_s = partial(q, pool, torch.where(split == slot, rows, -1))
            o, lse = merge_local_corpus(o, lse, o_s, l_s)
        return o, lse

    variants: dict[str, Callable[[], Any]] = {
        "local": lambda: partial(q, local, rows),
        "in_place": lambda: partial(q, peer, rows),
        "split_in_place": split_in_place,
    }
    for c in a.chunks:
        if c > n and c != a.chunks[0]:  # one chunk of all n rows is timed once
            continue
        variants[f"staged/{c}"] = functools.partial(
            device.staged_partial, [peer], q, on_peer, rows, c, partial
        )
        variants[f"split_staged/{c}"] = functools.partial(
            device.staged_partial, [local, peer], q, split, rows, c, partial
        )
    row: dict[str, Any] = {"rows": n, "topk": k, "heads": a.heads}
    for name, fn in variants.items():
        o = fn()[0]
        row[name] = trials(fn, a.reps, a.trials)
        row[name]["max_abs_diff_vs_local"] = float((o - ref_o).abs().max())
    for name, fn in own_and_corpus(q, peer, local, rows, partial, g).items():
        row[name] = trials(fn, a.reps, a.trials)
    m = min(n * k, peer.shape[0])  # the copy engine's contiguous rows (the pool's at most)
    flat = torch.empty(m, D_QK, dtype=torch.bfloat16, device=dev)
    for name, fn, moved in (
        ("copy", lambda: device.stage_rows([peer], on_peer, rows), n * k * D_QK * 2),
        ("copy_engine_contiguous", lambda: flat.copy_(peer[:m]), m * D_QK * 2),
    ):
        t = trials(fn, a.reps, a.trials)
        row[name] = {**t, "bytes": moved, "gb_s": round(moved / t["median_us"] / 1e3, 1)}
    return row


def own_and_corpus(
    q: torch.Tensor, peer: torch.Tensor, own_kv: torch.Tensor, rows: torch.Tensor,
    partial: device.Partial, g: torch.Generator,
) -> dict[str, Callable[[], Any]]:  # fmt: skip
    """A decode layer's whole attention, a tenth of each row's top-k slots its own tokens (rows
    of ``own_kv``, SGLang's cache here) and the rest the corpus on ``peer``:

    - ``two_call``: SGLang's call over the own slots (its O rounded to bf16, as SGLang's is), the
      corpus call over the peer pool in place, the LSE merge: the device path today;
    - ``one_call``: both sides copied into one buffer, the corpus rows through the rope band's
      column map, and one call (``device.one_call_partial``'s kernels,
      ``CORPUSD_SGLANG_ONE_CALL``)."""
    n, k = rows.shape
    own = torch.rand(n, k, device=rows.device, generator=g) < 0.1
    own_rows = torch.randint(0, own_kv.shape[0], (n, k), device=rows.device, generator=g)
    own_rows = torch.where(own, own_rows.to(torch.int32), -1)
    corpus = torch.where(own, -1, rows)
    cols: list[torch.Tensor | None] = [device.sglang_columns(D_QK, rows.device), None]

    def two_call() -> Any:
        o_own, l_own = partial(q, own_kv, own_rows)
        o_c, l_c = partial(q, peer, corpus)
        return merge_local_corpus(o_own.bfloat16(), l_own, o_c, l_c)

    def one_call() -> Any:
        holder = own.to(torch.int32)  # slot 1: the own cache
        return device.staged_partial([peer, own_kv], q, holder, torch.where(own, own_rows, corpus),
                                     n, partial, cols)  # fmt: skip

    return {"two_call": two_call, "one_call": one_call}


def table(res: dict[str, Any]) -> str:
    lines = ["rows  local  in_place  staged(best)  split_in_place  split_staged(best)  copy GB/s"]
    for r in res["rows"]:
        st = min((v["median_us"], k) for k, v in r.items() if k.startswith("staged/"))
        ss = min((v["median_us"], k) for k, v in r.items() if k.startswith("split_staged/"))
        lines.append(
            f"{r['rows']:>4} {r['local']['median_us']:>6} {r['in_place']['median_us']:>9} "
            f"{st[0]:>8} ({st[1][7:]}) {r['split_in_place']['median_us']:>15} "
            f"{ss[0]:>13} ({ss[1][13:]}) {r['copy']['gb_s']:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results/peer-read.json")
    ap.add_argument("--pool-tokens", type=int, default=262144)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[8, 32, 128])
    ap.add_argument("--chunks", type=lambda v: [int(x) for x in v.split(",")],
                    default=[16, 32, 64, 128])  # fmt: skip
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--same-gpu", action="store_true",
        help="both pools on GPU 0: the kernels and the copy's HBM bandwidth, no link",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if torch.cuda.device_count() < 2 and not a.same_gpu:
        ap.error("needs two GPUs that reach each other by peer access (or --same-gpu)")
    res = {"command": command(), **run(a)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
