"""SGLang's own prefill of the token ids ``tools/bench_pin.py`` pinned, timed on one stock server
(``bench_pin --sglang``: issue 18's "GPU pin" comparison, corpusd tok/s over SGLang's).

The server is :class:`tools.sglang_server.Server` in ``stock`` mode with :func:`prefill_flags`:
the flags every SGLang run here uses (:func:`tools.sglang_server.sglang_flags`: bf16 KV cache,
``flashmla_sparse`` NSA prefill, ``--skip-tokenizer-init``) with a context length, KV pool and
chunked-prefill size that fit the longest measured request. It starts once, after corpusd's pins
(so the two never share the GPU). Each timed request is ``POST /generate`` with ``input_ids`` and
``max_new_tokens: 1``, sent right after ``/flush_cache`` (the reply's ``cached_tokens`` must be
0): its client-side wall time is SGLang's time to first token over the whole prefill, and
tok/s = tokens / that time (the median of a few). SGLang's own ``e2e_latency`` and, with
``--enable-metrics``, ``inference_time`` (forward entry to finish) are recorded beside it. One
warm-up request goes first and is not timed: on a cold machine SGLang compiles JIT kernels on
first use.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tools.sglang_server import SGLANG_ENV, Server, post_json, sglang_flags

#: SGLang's NSA top-k kernels (sgl_kernel ``fast_topk_v2`` and the fused transforms) assert
#: topk == 2048, DeepSeek-V3.2's own; the ``sglang`` preset's 128 would fail past 128 tokens.
SGLANG_TOPK = 2048
#: SGLang 0.5.10's own ``--chunked-prefill-size`` default on 60–160 GB GPUs (H100, H200).
CHUNK = 8192
#: SGLang refuses ``input >= min(context - 1, pool - 1) - 5`` (scheduler) and
#: ``input + max_new_tokens >= context`` (tokenizer manager): with 1 new token an input of
#: ``n`` tokens needs ``n + HEADROOM`` of context and of KV pool.
HEADROOM = 7
#: corpusd tok/s over SGLang's that issue 18 asks for.
GOAL = 0.5
#: What a result records of the server's own resolved arguments and limits (``/server_info``).
INFO_KEYS = (
    "version", "context_length", "chunked_prefill_size", "max_prefill_tokens",
    "max_running_requests", "mem_fraction_static", "kv_cache_dtype", "page_size",
    "attention_backend", "nsa_prefill_backend", "disable_cuda_graph",
    "disable_piecewise_cuda_graph", "max_total_num_tokens", "max_req_input_len",
)  # fmt: skip


def context_for(longest: int, positions: int) -> int:
    """``--context-length`` (and ``--max-total-tokens``) for requests of up to ``longest``
    tokens: ``longest + HEADROOM`` rounded up to 1,024, at most the model's ``positions``
    (SGLang refuses more than ``max_position_embeddings`` unless overridden)."""
    return min(positions, -(-(longest + HEADROOM) // 1024) * 1024)


def prefill_flags(context_length: int, chunk: int = CHUNK) -> list[str]:
    """The launch flags (without model path and port): :func:`sglang_flags` with
    ``--context-length`` and ``--max-total-tokens`` both ``context_length`` (one request at a
    time holds the pool), ``--chunked-prefill-size chunk`` and 4 running requests at most."""
    flags = sglang_flags("auto")
    want = {
        "--context-length": context_length,
        "--max-total-tokens": context_length,
        "--chunked-prefill-size": chunk,
        "--max-running-requests": 4,
    }
    for name, value in want.items():
        if name in flags:
            flags[flags.index(name) + 1] = str(value)
        else:
            flags += [name, str(value)]
    return flags


def positions_skip(size: int, positions: int) -> dict[str, str] | None:
    """Why neither corpusd nor SGLang can take ``size`` tokens of this model (None: both can)."""
    if size <= positions:
        return None
    why = f"{size:,} tokens is past the model's {positions:,} positions (max_position_embeddings)"
    return {"skipped": "positions", "reason": why}


def sglang_skip(
    tokens: int, context_length: int, info: dict[str, Any] | None = None
) -> dict[str, str] | None:
    """Why the server started with ``context_length`` (and reporting ``info``, its
    ``/server_info``) cannot prefill ``tokens`` with one new token; None when it can.
    ``skipped`` is ``context-length`` or ``memory`` (the KV pool SGLang could allocate was the
    smaller limit)."""
    if tokens + HEADROOM > context_length:
        why = (
            f"{tokens:,} tokens + {HEADROOM} > --context-length {context_length:,} "
            "(capped at the model's positions)"
        )
        return {"skipped": "context-length", "reason": why}
    if info is None or tokens < int(info["max_req_input_len"]):
        return None
    pool = int(info["max_total_num_tokens"])
    kind = "memory" if pool < context_length else "context-length"
    why = (
        f"{tokens:,} tokens ≥ SGLang's max_req_input_len {info['max_req_input_len']:,} "
        f"(KV pool {pool:,} tokens, --context-length {context_length:,})"
    )
    return {"skipped": kind, "reason": why}


def reps_for(tokens: int) -> int:
    """Timed repetitions: 5 up to 32k tokens, 3 beyond (a median either way)."""
    return 5 if tokens <= 32768 else 3


#: Timed seconds per size after which no further repetition starts (keeps a slow size's run
#: inside the device's 10-minute command limit; the row says how many ran).
BUDGET_S = 60.0


def flush(url: str) -> None:
    """``/flush_cache``: empty SGLang's radix cache. RuntimeError when SGLang refuses (it does
    while requests are running)."""
    req = urllib.request.Request(url + "/flush_cache", b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"/flush_cache refused ({e.code}): {e.read().decode()[:300]}") from e


def generate(url: str, ids: list[int], timeout: float = 600) -> tuple[float, dict[str, Any]]:
    """One greedy ``/generate`` of ``ids`` with one new token: (wall s, the reply's meta_info)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    reply = post_json(url + "/generate", body, timeout)
    return time.perf_counter() - t0, dict(reply["meta_info"])


def server_info(url: str) -> dict[str, Any]:
    """:data:`INFO_KEYS` of the server's ``/server_info`` (its resolved args, pool, version)."""
    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        info = json.loads(r.read())
    return {k: info.get(k) for k in INFO_KEYS}


def warm_up(url: str, ids: list[int], chunk: int = CHUNK) -> float:
    """One untimed request of up to 1.5 chunks of ``ids`` (a full chunk, then one that attends
    to it: every prefill kernel compiled); its wall seconds, JIT included."""
    flush(url)
    return generate(url, ids[: chunk + chunk // 2])[0]


def time_prefill(
    url: str, ids: list[int], reps: int, timeout: float = 600, budget_s: float = BUDGET_S
) -> dict[str, Any]:
    """Up to ``reps`` × (flush, prefill ``ids``), none started once ``budget_s`` is spent; tok/s
    from the median wall time. RuntimeError when SGLang served any of it from its cache (the
    time would not be a whole prefill)."""
    walls: list[float] = []
    metas: list[dict[str, Any]] = []
    while len(walls) < reps and sum(walls) < budget_s:
        flush(url)
        wall, meta = generate(url, ids, timeout)
        if meta.get("cached_tokens"):
            raise RuntimeError(
                f"{meta['cached_tokens']} of {len(ids)} tokens came from SGLang's cache after "
                "/flush_cache: not a whole prefill"
            )
        walls.append(wall)
        metas.append(meta)
    ttft = statistics.median(walls)
    row: dict[str, Any] = {
        "tokens": len(ids),
        "reps": len(walls),
        "ttft_s": [round(w, 4) for w in walls],
        "ttft_median_s": round(ttft, 4),
        "tok_per_s": round(len(ids) / ttft, 1),
        "prompt_tokens": metas[0].get("prompt_tokens"),
    }
    for key in ("e2e_latency", "inference_time"):  # SGLang's own clocks, where it gives them
        if all(isinstance(m.get(key), int | float) for m in metas):
            row[f"server_{key}_median_s"] = round(statistics.median(m[key] for m in metas), 4)
    return row


def run_sglang(
    model: Path, ids_by_size: dict[int, list[int]], positions: int, port: int, log: Path,
    reps: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Start one stock server on ``model``, warm it up, and time its prefill of each size's ids
    (``reps`` each; 0: :func:`reps_for`). Per size: :func:`time_prefill`'s row, a skip
    (:func:`sglang_skip`) or ``failed`` with the error and the log's tail; and what ran."""
    longest = max(map(len, ids_by_size.values()))
    context = context_for(longest, positions)
    server = Server("stock", model, port, None, log, flags=prefill_flags(context))
    out: dict[str, Any] = {"argv": server.cmd[1:], "env": SGLANG_ENV, "log": str(log)}
    try:
        out["version"] = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        out["version"] = None  # the server will not start either; "failed" says so
    rows: dict[str, Any] = {}
    out["rows"] = rows
    try:
        out["start_s"] = round(server.wait(), 1)
        info = server_info(server.url)
        out["server"] = info
        first = min(ids_by_size.values(), key=len)
        out["warmup"] = {"tokens": min(len(first), CHUNK + CHUNK // 2)}
        out["warmup"]["s"] = round(warm_up(server.url, first), 2)
        for size, ids in ids_by_size.items():
            skip = sglang_skip(len(ids), context, info)
            if skip is not None:
                rows[str(size)] = {"tokens": len(ids), **skip}
                continue
            try:
                rows[str(size)] = time_prefill(server.url, ids, reps or reps_for(len(ids)))
            except (OSError, RuntimeError, KeyError) as e:  # the other sizes still run
                rows[str(size)] = {"tokens": len(ids), "failed": f"{type(e).__name__}: {e}"[:500]}
                rows[str(size)]["log_tail"] = server.tail(30)
                if server.proc.poll() is not None:
                    break
    except (OSError, RuntimeError, TimeoutError) as e:  # the pins' numbers still get written
        out["failed"] = f"{type(e).__name__}: {e}"[:4000]
    finally:
        server.stop()
    return out


def failures(sglang: dict[str, Any]) -> list[str]:
    """What of a :func:`run_sglang` result failed (the server, or a size), one line each."""
    out = [f"server: {sglang['failed']}"] if "failed" in sglang else []
    rows = sglang.get("rows", {})
    return out + [f"{size}: {r['failed']}" for size, r in rows.items() if "failed" in r]


def compare(
    corpusd: dict[int, dict[str, Any]], sglang: dict[str, Any], goal: float = GOAL
) -> dict[str, Any]:
    """Per size: corpusd's and SGLang's tok/s and their ratio (corpusd / SGLang), or why a side
    has no number; ``goal_met`` over the sizes both measured (None when there are none)."""
    rows = []
    for size, c in corpusd.items():
        s = sglang.get("rows", {}).get(str(size), {})
        row: dict[str, Any] = {"size": size, "corpusd_tok_per_s": c.get("tok_per_s")}
        row["sglang_tok_per_s"] = s.get("tok_per_s")
        if row["corpusd_tok_per_s"] and row["sglang_tok_per_s"]:
            row["ratio"] = round(row["corpusd_tok_per_s"] / row["sglang_tok_per_s"], 3)
        else:
            row["ratio"] = None
            row["why"] = (
                c.get("reason")
                or s.get("reason")
                or s.get("failed")
                or sglang.get("failed", "not measured")
            )
        rows.append(row)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    met = all(r >= goal for r in ratios) if ratios else None
    return {"goal": goal, "rows": rows, "min_ratio": min(ratios, default=None), "goal_met": met}
