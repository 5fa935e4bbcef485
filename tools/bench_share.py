"""The equal-HBM benchmark (issue 35, item 7): N SGLang workers over one shared corpus, stock
SGLang against SGLang with corpusd, both spending the same KV bytes.

"I have G GPUs and N workers: how many sub-agent sessions, and how many output tokens per
second, do I get with corpusd against stock SGLang when both spend the same HBM?"

- **stock**: N ``sglang.launch_server`` workers, each with ``--max-total-tokens K``; every
  session's prompt is the corpus plus its own question, so each worker holds the corpus in its
  radix cache once and its sessions' own tokens beside it.
- **corpusd**: the same N workers with the plugin (``SGLANG_EXTERNAL_MODEL_PACKAGE=
  requester.sglang``) and the corpus pinned once on holders. The holders' resident bytes count
  against the same total: ``N · K_route · b + holder bytes = N · K · b`` where ``b`` is the bytes
  per token of SGLang's own KV pool (latent row + fp8 index key, every layer; :func:`pool_bytes`).
  A session's prompt is its question alone.

For each corpus size as a fraction of ``K`` (``--fractions``), each side runs a closed loop at
rising concurrency (``--concurrency``, per worker): every client sends a session (its question,
``--tokens`` output tokens, ignore-eos), waits for it, sends the next. A point's first trial
is a warm-up and is discarded; then ``--trials`` trials, reported as median and spread.
Output tokens are the servers' own counts (``sglang:generation_tokens_total``), inter-token and
first-token latencies the servers' own histograms (their deltas over a trial), besides the
client's per-token gaps (a chunk of ``k`` new tokens counts as ``k`` gaps). Sessions held at
once: the most ``sglang:num_running_reqs`` summed over the workers, sampled every 50 ms. The
clients are dealt over ``--client-procs`` processes (default two a worker): one Python process
parses about 12,000 streamed tokens a second at most on a 2-core CPU machine
(``tools/bench_client_cap.py``), and each trial records its busiest process's share of a core
(``client_busy_max``).

Exactness beside the speed (issue 36): after each side's warm-up, 8 sessions are teacher-forced
8 steps on every worker, on stock's first worker's greedy answers (:func:`probe`); each point's
``exactness`` reads route's first worker against stock's beside stock's two workers against
each other (two separately started servers: the noise floor) and route's two workers.

Run on a GPU host with ``.sglang-deps`` installed (``bash tools/gpu_session.sh share``)::

    python -m tools.bench_share --servers 2 --out bench/results/share-h100.json

All N workers and the holder share ``--device``'s GPU unless ``--gpus G`` deals the workers over
GPUs 0 … G−1 (SGLang's ``--base-gpu-id``, worker ``i`` on GPU ``i mod G``), on both sides alike;
the holder stays on ``--device`` and corpusd's workers on the other GPUs read its one copy over
peer access (the device path's ``cuda_p2p``). Each worker still spends ``--mem-fraction`` of its
GPU and ``K`` tokens of KV. ``--spread`` splits the one copy over a holder on each of the G
GPUs instead: a worker's selected rows then come 1/G from its own GPU and the rest from G-1
peers, where with one holder every peer read leaves GPU 0's links (measured with N = 4 on 4 x
H200, bench/results/share-h200x4-n4.json, 32 clients a worker: inter-token p50 4.9 ms with
128 sessions held, stock's 1.0 ms with 71).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from corpusd import env
from corpusd.testing.span_qa import stdlib_corpus
from corpusd.tokenizer import ByteTokenizer
from tools.bench_sglang import teacher_forced
from tools.sglang_compare import against_floor, forced_compare
from tools.sglang_server import (
    Corpusd,
    Server,
    request,
    sglang_flags,
    start_corpusd,
    start_pinned,
)
from tools.share_load import cpu_s, load_in_processes, run_clients

PAGE = 64  # corpusd's page: a holder's capacity is whole pages

#: The SGLang flags the bench sets beyond tools/sglang_server.sglang_flags, and why (the JSON
#: records them): two workers and a holder share one GPU, so each worker takes a slice of it.
WHY_FLAGS = {
    "--max-total-tokens": "the KV budget K (stock) or K_route (corpusd) under test",
    "--context-length": "the corpus plus a question and its answer fits one stock request",
    "--mem-fraction-static": "N workers and the holder share the GPU",
    "--cuda-graph-bs": "graphs for the batch sizes the sweep reaches (both sides the same)",
}


def pool_bytes(cfg: dict[str, Any], kv_cache_dtype: str = "auto") -> int:
    """Bytes one token takes in SGLang's NSA KV pool over all layers: the latent row (bf16
    ``kv_lora_rank + qk_rope_head_dim``, or FlashMLA's 656-byte fp8 row) plus the indexer's fp8
    key with one float32 scale per 128 values."""
    if kv_cache_dtype == "fp8_e4m3":
        row = cfg["kv_lora_rank"] + 4 * (cfg["kv_lora_rank"] // 128) + 2 * cfg["qk_rope_head_dim"]
    else:
        row = 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    index = cfg["index_head_dim"] + 4 * max(1, cfg["index_head_dim"] // 128)
    return (row + index) * int(cfg["num_hidden_layers"])


def route_budget(k_tokens: int, servers: int, holder_bytes: float, token_bytes: int) -> int:
    """``K_route``: each worker's KV tokens when ``servers`` workers and holders holding
    ``holder_bytes`` spend what ``servers`` stock workers of ``k_tokens`` do; ≤ 0 when the
    pinned copy alone takes the whole budget."""
    return int(k_tokens - holder_bytes / (servers * token_bytes))


def holder_layout(corpus_tokens: int, device: str, gpus: int, spread: bool) -> tuple[int, str, int]:
    """``(holders, their devices, each holder's capacity in tokens)`` for ``start_corpusd``: one
    holder on ``device`` with room for the whole corpus, or with ``spread`` one holder on each
    of GPUs 0 … ``gpus``-1, each with room for a 1/``gpus`` share and a page over, so that no
    ``gpus`` − 1 of them can hold the corpus and the placement's water-fill uses all of them
    evenly. ``corpus_tokens`` is the size asked for; the pinned corpus may run a few percent
    over (whole files), which the share's 2 % and one page a holder absorb."""
    if not spread:
        return 1, device, -(-corpus_tokens // 4096) * 4096 + 4096
    pages = -(-corpus_tokens * 102 // (100 * PAGE)) + gpus
    cap = (-(-pages // gpus) + 1) * PAGE
    return gpus, ",".join(f"cuda:{i}" for i in range(gpus)), cap


def staging(cfg: dict[str, Any], peers: bool) -> dict[str, Any]:
    """How the route workers read pools on other GPUs (``CORPUSD_SGLANG_STAGE_ROWS`` from this
    process's environment, which the servers inherit) and the staging buffer that costs a
    worker outside ``--max-total-tokens``: query rows × top-k × the pool's bf16 row (a
    temporary of the decode graphs' memory pool, like SGLang's own activations)."""
    rows = int(env.get("CORPUSD_SGLANG_STAGE_ROWS"))
    row_bytes = 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    used = peers and rows > 0
    return {
        "CORPUSD_SGLANG_STAGE_ROWS": rows,
        "staged": used,
        "buffer_bytes_per_worker": rows * cfg["index_topk"] * row_bytes if used else 0,
        "counted_in_k": False,
    }


def parse_env(spec: str) -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE]`` of corpusd's variables (``corpusd.env``), each checked as the
    plugin will read it. Raises ValueError naming what is wrong."""
    got: dict[str, str] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r}: want KEY=VALUE")
        if key not in env.VARS:
            raise ValueError(f"{key} is not a corpusd variable (python -m corpusd.env lists them)")
        env.get(key, {key: value})  # EnvError (a ValueError) for a value it would refuse
        got[key] = value
    return got


def pin_shared(
    a: argparse.Namespace, work: Path, model: Path, name: str, src: Path, holders: int,
    devices: str, cap: int,
) -> Corpusd:  # fmt: skip
    """corpusd's daemons with the corpus ``src`` pinned as ``name``: prefilled by corpusd on
    ``--device``, or with ``--pin-engine`` through a stock SGLang server in capture mode, so the
    pinned pages are the ones stock computes for itself (the exactness probe then compares
    route with stock on stock's own pages; a capture server is started and stopped first)."""
    if a.pin_engine:
        return start_pinned(work, model, {name: (0, "")}, holders, devices, "auto",
                            a.port + 90, {name: src}, cap)  # fmt: skip
    return start_corpusd(work, model, {name: (0, "")}, holders, devices, "plain",
                         capacity_tokens=cap, pin_device=a.device, sources={name: src})  # fmt: skip


def quantile(buckets: dict[float, float], q: float) -> float:
    """The ``q`` quantile of a Prometheus histogram given as cumulative ``le → count``
    (interpolated linearly inside the bucket, as ``histogram_quantile`` does); NaN if empty."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return math.nan
    want, lo, below = q * total, 0.0, 0.0
    for le in edges:
        if buckets[le] >= want:
            if math.isinf(le):
                return lo
            inside = buckets[le] - below
            return lo + (le - lo) * ((want - below) / inside if inside else 1.0)
        lo, below = le, buckets[le]
    return lo


class Endpoint(Protocol):
    """What a trial reads of a server: its base URL (``/generate``, ``/metrics``)."""

    @property
    def url(self) -> str: ...


def scrape(server: Endpoint) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
        return str(r.read().decode())


def counter(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in a Prometheus text page."""
    pat = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(v) for v in re.findall(pat, text, re.M))


def histogram(text: str, name: str) -> dict[float, float]:
    """``name``'s cumulative buckets, ``le → count``, summed over label sets."""
    out: dict[float, float] = {}
    pat = rf'^{re.escape(name)}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} (\S+)$'
    for le, v in re.findall(pat, text, re.M):
        out[float(le)] = out.get(float(le), 0.0) + float(v)
    return out


def delta(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {le: v - before.get(le, 0.0) for le, v in after.items()}


def questions(corpus: Path, n: int) -> list[str]:
    """``n`` distinct questions about functions defined in the corpus."""
    names = sorted(
        {
            m
            for f in sorted(corpus.glob("*.py"))
            for m in re.findall(r"^def (\w+)", f.read_text(), re.M)
        }
    )
    assert names, f"no functions in {corpus}"
    return [f"\n\nQ: what does {names[i % len(names)]} return? ({i})\nA:" for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


@dataclass(frozen=True)
class Load:
    """What every client of a trial sends: session ``i`` asks ``prompts[i % len(prompts)]`` for
    ``n_tokens`` tokens of ``corpus`` in ``mode`` (:func:`tools.sglang_server.request`)."""

    mode: str
    corpus: str
    prompts: list[list[int]]
    n_tokens: int

    def body(self, i: int) -> dict[str, Any]:
        prompt = self.prompts[i % len(self.prompts)]
        return request(prompt, self.n_tokens, self.mode, self.corpus, i, 0, False)


def trial(
    servers: Sequence[Endpoint],
    mode: str,
    corpus: str,
    prompts: list[list[int]],
    concurrency: int,
    n_tokens: int,
    sessions_each: int,
    procs: int = 1,
) -> dict[str, Any]:
    """A closed loop: ``concurrency`` clients per worker, each running ``sessions_each``
    sessions back to back; the servers' own token counts and latency histograms over it. The
    clients run in ``procs`` processes (1: threads of this one), and the trial records each
    one's CPU seconds over the wall time (``client_busy_max`` near 1: a load generator that
    could not keep up, and a trial that measured it rather than the servers)."""
    before = [scrape(s) for s in servers]
    running = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                now = sum(counter(scrape(s), "sglang:num_running_reqs") for s in servers)
                running.append(now)
            except OSError:
                pass
            time.sleep(0.05)

    load, clients = Load(mode, corpus, prompts, n_tokens), concurrency * len(servers)
    each = range(sessions_each)
    work = {w: [load.body(w * sessions_each + j) for j in each] for w in range(clients)}
    urls, procs = [s.url for s in servers], max(1, min(procs, clients))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        if procs == 1:
            t0, cpu0 = time.monotonic(), cpu_s()
            sessions = run_clients(urls, work)
            wall, cpus = time.monotonic() - t0, [cpu_s() - cpu0]  # the sampler's share too
        else:
            sessions, wall, cpus = load_in_processes(urls, work, procs)
    finally:
        stop.set()
        sampler.join()
    after = [scrape(s) for s in servers]
    tokens = sum(
        counter(a, "sglang:generation_tokens_total") - counter(b, "sglang:generation_tokens_total")
        for a, b in zip(after, before, strict=True)
    )
    itl: dict[float, float] = {}
    ttft: dict[float, float] = {}
    for a, b in zip(after, before, strict=True):
        for acc, name in (
            (itl, "sglang:inter_token_latency_seconds"),
            (ttft, "sglang:time_to_first_token_seconds"),
        ):
            for le, v in delta(histogram(a, name), histogram(b, name)).items():
                acc[le] = acc.get(le, 0.0) + v
    gaps = [g for s in sessions for g in s.gaps]
    firsts = [s.ttft for s in sessions if not math.isnan(s.ttft)]
    errors = [s.error for s in sessions if s.error]
    return {
        "concurrency_per_worker": concurrency,
        "sessions": len(sessions),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "wall_s": wall,
        "server_tokens": tokens,
        "client_tokens": sum(s.tokens for s in sessions),
        "tokens_per_s": tokens / wall,
        "sessions_held_max": max(running),
        "itl_server_p50_ms": 1e3 * quantile(itl, 0.5),
        "itl_server_p99_ms": 1e3 * quantile(itl, 0.99),
        "ttft_server_p50_ms": 1e3 * quantile(ttft, 0.5),
        "ttft_server_p99_ms": 1e3 * quantile(ttft, 0.99),
        "itl_client_p50_ms": 1e3 * pct(gaps, 50),
        "itl_client_p99_ms": 1e3 * pct(gaps, 99),
        "ttft_client_p50_ms": 1e3 * pct(firsts, 50),
        "ttft_client_p99_ms": 1e3 * pct(firsts, 99),
        "client_procs": procs,
        "client_cpu_s": sum(cpus),
        "client_busy_max": max(cpus) / wall if wall > 0 else math.nan,
    }


def client_procs(asked: int, servers: int) -> int:
    """Load-generator processes: ``asked``, or with 0 two per worker, at most half the cores
    (the workers' own processes need the rest)."""
    if asked > 0:
        return asked
    return max(1, min(2 * servers, (os.cpu_count() or 2) // 2))


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread (min, max) of every number over a point's trials."""
    out: dict[str, Any] = {"trials": len(trials)}
    for k, v in trials[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs = [float(t[k]) for t in trials if not math.isnan(float(t[k]))]
            out[k] = (
                {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None
            )
    out["errors_total"] = sum(t["errors"] for t in trials)
    out["error_examples"] = sorted({e for t in trials for e in t["error_examples"]})[:3]
    return out


def headline(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s at saturation (the best median over the concurrencies) and at the latency bound
    (the best median whose p99 server inter-token time ≤ 2× the lowest concurrency's)."""
    ok = [p for p in points if p.get("tokens_per_s") and p["errors_total"] == 0]
    if not ok:
        return {"served": False}
    unloaded = ok[0]["itl_server_p99_ms"]["median"] if ok[0]["itl_server_p99_ms"] else math.nan
    bound = [
        p for p in ok if p["itl_server_p99_ms"] and p["itl_server_p99_ms"]["median"] <= 2 * unloaded
    ]
    best = max(ok, key=lambda p: p["tokens_per_s"]["median"])
    return {
        "served": True,
        "tokens_per_s_saturation": best["tokens_per_s"]["median"],
        "tokens_per_s_at_2x_itl": max((p["tokens_per_s"]["median"] for p in bound), default=None),
        "sessions_held_max": max(p["sessions_held_max"]["median"] for p in ok),
        "unloaded_itl_p99_ms": unloaded,
    }


#: the exactness probe (issue 36): sessions teacher-forced on every worker, and steps each
PROBE_SESSIONS, PROBE_STEPS = 8, 8


def probe(
    servers: list[Server], mode: str, corpus: str, prompts: list[list[int]], vocab: int,
    ref: list[list[int]] | None,
) -> tuple[list[list[int]], list[list[list[list[float]]]]]:  # fmt: skip
    """The first :data:`PROBE_SESSIONS` sessions teacher-forced :data:`PROBE_STEPS` steps on
    every worker, on ``ref`` (stock's first worker's greedy answers; this side's first worker's
    when None): (the answers, per worker ``[session][step][vocab]`` log-softmax)."""
    prompts = prompts[:PROBE_SESSIONS]
    if ref is None:
        ref = [
            servers[0].post(request(p, PROBE_STEPS, mode, corpus, i, vocab, False))["output_ids"]
            for i, p in enumerate(prompts)
        ]
    return ref, [teacher_forced(s, mode, corpus, prompts, ref, vocab, PROBE_STEPS) for s in servers]


def exactness(stock: list[Any] | None, route: list[Any] | None) -> dict[str, Any]:
    """Route's first worker against stock's on the same teacher-forced contexts, beside stock's
    two workers against each other (two separately started servers: the noise floor) and route's
    two workers; each :func:`tools.sglang_compare.forced_compare`, route against the floor
    as :func:`tools.sglang_compare.against_floor` reads it. A side that did not run is left out."""
    out: dict[str, Any] = {"sessions": PROBE_SESSIONS, "steps": PROBE_STEPS}
    floors = {}
    if stock and len(stock) > 1:
        floors["two_servers"] = out["stock_vs_stock"] = forced_compare(stock[0], stock[1])
    if route and len(route) > 1:
        out["route_vs_route"] = forced_compare(route[0], route[1])
    if stock and route:
        got = forced_compare(stock[0], route[0])
        out["route_vs_stock"] = got
        out["vs_floor"] = against_floor(got, floors)
    return out


SIDES = ("stock", "corpusd")


def stock_ref(point: dict[str, Any]) -> list[list[int]] | None:
    """Stock's probe answers at this point, for route to be forced on (None: stock did not
    run here, route's own first worker answers)."""
    got = point.get("stock", {}).get("_probe")
    return got[0] if got else None


def start_side(
    mode: str,
    n: int,
    model: Path,
    cd: Corpusd,
    port: int,
    k: int,
    ctx: int,
    mem: float,
    graph_bs: tuple[int, ...],
    work: Path,
    gpus: int = 1,
    extra_env: dict[str, str] | None = None,
) -> list[Server]:
    """``n`` workers of side ``mode``; ``gpus`` > 1: worker ``i`` on GPU ``i mod gpus``;
    ``extra_env``: plugin variables for these workers (``--route-alt-env``)."""
    flags = sglang_flags()
    for name, value in (
        ("--max-total-tokens", k),
        ("--context-length", ctx),
        ("--mem-fraction-static", mem),
    ):
        flags[flags.index(name) + 1] = str(value)
    on = [[] if gpus <= 1 else ["--base-gpu-id", str(i % gpus)] for i in range(n)]
    servers = [
        Server(
            mode,
            model,
            port + 10 * i,
            cd if mode != "stock" else None,
            work / f"sglang-{mode}-{k}-{i}{'-alt' if extra_env else ''}.log",
            graph_bs,
            flags=[*flags, *on[i]],
            extra_env=extra_env,
        )
        for i in range(n)
    ]
    try:
        for s in servers:
            s.wait(timeout=600)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def run_side(
    a: argparse.Namespace,
    mode: str,
    model: Path,
    cd: Corpusd,
    k: int,
    corpus: str,
    prompts: list[list[int]],
    work: Path,
    vocab: int = 0,
    ref: list[list[int]] | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One side at one KV budget: start its workers, sweep the concurrency, stop them. With
    ``vocab``, first :func:`probe` the workers (on ``ref``): ``out["_probe"]`` = (answers,
    vectors), for the caller to compare and drop. ``extra_env``: the workers' plugin
    variables besides the environment's (recorded as ``out["env"]``)."""
    ctx = len(cd.tokens[corpus]) + 4096
    graph_bs = tuple(int(c) for c in a.graph_bs.split(",") if c)
    t0 = time.monotonic()
    try:
        servers = start_side(
            mode, a.servers, model, cd, a.port, k, ctx, a.mem_fraction, graph_bs, work, a.gpus,
            extra_env,
        )  # fmt: skip
    except (RuntimeError, TimeoutError) as e:
        return {"k_tokens": k, "started": False, "error": str(e)[-1500:]}
    out: dict[str, Any] = {"k_tokens": k, "started": True, "start_s": time.monotonic() - t0}
    if extra_env:
        out["env"] = dict(extra_env)
    try:
        procs = client_procs(a.client_procs, a.servers)
        warm = trial(servers, mode, corpus, prompts, 1, a.tokens, 1)  # radix cache, first graphs
        out["warmup"] = {"errors": warm["errors"], "examples": warm["error_examples"]}
        if vocab:
            try:
                out["_probe"] = probe(servers, mode, corpus, prompts, vocab, ref)
            except (OSError, RuntimeError, KeyError) as e:  # the timing still runs
                out["probe_error"] = f"{type(e).__name__}: {e}"[:500]
        points = []
        for c in (int(x) for x in a.concurrency.split(",")):
            trial(servers, mode, corpus, prompts, c, a.tokens, 1, procs)  # first burst: discarded
            runs = [
                trial(servers, mode, corpus, prompts, c, a.tokens, a.sessions_each, procs)
                for _ in range(a.trials)
            ]
            points.append(summarize(runs))
            p = points[-1]
            print(
                f"  {mode} K={k} c={c}/worker: {p['tokens_per_s']['median']:.0f} tok/s, "
                f"held {p['sessions_held_max']['median']:.0f}, "
                f"itl p50/p99 {p['itl_server_p50_ms']['median']:.2f}/"
                f"{p['itl_server_p99_ms']['median']:.2f} ms, errors {p['errors_total']}, "
                f"load generator's busiest process {p['client_busy_max']['max']:.2f} of a core",
                flush=True,
            )
        out["points"] = points
        out["headline"] = headline(points)
    finally:
        for s in servers:
            s.stop()
    return out


def gpu_name() -> str:
    try:
        got = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return got.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def plot(out: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for side in ("stock", "corpusd"):
        xs, ys = [], []
        for p in out["points"]:
            h = p.get(side, {}).get("headline", {})
            xs.append(p["fraction"])
            ys.append(h.get("tokens_per_s_saturation") or 0.0)
        ax.plot(xs, ys, marker="o", label=side)
        for p in out["points"]:  # served, but with more than stock's bytes
            if p.get(side, {}).get("equal_hbm") is False:
                h = p[side].get("headline", {})
                y = h.get("tokens_per_s_saturation") or 0.0
                ax.annotate("over equal HBM", (p["fraction"], y), textcoords="offset points",
                            xytext=(-60, -14), fontsize=8)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("corpus / K (per-worker KV budget)")
    ax.set_ylabel("output tokens/s, all workers (saturation)")
    ax.set_title(f"{out['servers']} workers, equal HBM, {out['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(out: dict[str, Any]) -> None:
    """The short table: each point's saturation tokens/s per side and sessions held."""
    print(
        f"{'corpus/K':>8} {'K':>7} {'K_route':>7} {'stock tok/s':>11} {'corpusd tok/s':>13} "
        f"{'ratio':>6} {'held s/c':>9}"
    )
    for p in out["points"]:
        hs = p.get("stock", {}).get("headline", {})  # a side not run has none
        hc = p.get("corpusd", {}).get("headline", {})
        ratio = p.get("corpusd_over_stock_saturation")
        print(
            f"{p['fraction']:>8g} {p['k_tokens']:>7} {p['k_route_tokens']:>7} "
            f"{hs.get('tokens_per_s_saturation') or 0:>11.0f} "
            f"{hc.get('tokens_per_s_saturation') or 0:>13.0f} "
            f"{ratio if ratio else float('nan'):>6.2f} "
            f"{hs.get('sessions_held_max', 0):>4.0f}/{hc.get('sessions_held_max', 0):<4.0f}"
        )
    for p in out["points"]:
        alt = p.get("corpusd_alt", {})
        if alt:
            sat = alt.get("headline", {}).get("tokens_per_s_saturation") or 0
            ratio = p.get("corpusd_alt_over_stock_saturation") or float("nan")
            print(f"{p['fraction']:>8g} corpusd with {alt.get('env')}: {sat:.0f} tok/s, "
                  f"{ratio:.2f}x stock")  # fmt: skip
    for p in out["points"]:
        for line in exactness_lines(p.get("exactness", {})):
            print(f"{p['fraction']:>8g} {line}")


def exactness_lines(e: dict[str, Any]) -> list[str]:
    """:func:`exactness` in a line per comparison: teacher-forced agreement and |Δ log-prob|."""
    out = []
    for name in ("stock_vs_stock", "route_vs_stock", "route_vs_route"):
        if name in e:
            c = e[name]
            out.append(f"{name:<15} forced {c['forced_agree_steps']}/{c['forced_steps']}, "
                       f"|Δ log-prob| max {c['logprob_max_abs_diff']:.3f} mean "
                       f"{c['logprob_mean_abs_diff']:.4f}")  # fmt: skip
    nf = e.get("vs_floor", {}).get("noisiest_floor")
    if nf:
        ratios = [nf[k] for k in ("max_over_floor", "mean_over_floor")]
        mx, mean = ("—" if r is None else f"{r:.2f}" for r in ratios)
        out.append(f"route over the floor: max ×{mx}, mean ×{mean}")
    return out


def merge(paths: list[str], out_path: str) -> int:
    """``--merge``: one result (JSON, PNG, table) from runs of the same setup over other
    fractions, as two device calls split the sweep; the points in fraction order."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = {
        **runs[0],
        "merged_from": [str(p) for p in paths],
        "commands": [r["command"] for r in runs],
    }
    by_fraction: dict[float, dict[str, Any]] = {}
    for p in (p for r in runs for p in r["points"]):  # a side that ran beats one that did not
        have = by_fraction.setdefault(p["fraction"], {})
        for key, value in p.items():
            if key not in have or not (isinstance(have[key], dict) and have[key].get("started")):
                have[key] = value
    out["points"] = [by_fraction[f] for f in sorted(by_fraction)]
    Path(out_path).write_text(json.dumps(out, indent=1))
    plot(out, Path(out_path).with_suffix(".png"))
    print_table(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/share.json")
    ap.add_argument("--work", default="/tmp/corpusd-bench-share")
    ap.add_argument("--servers", type=int, default=2, help="SGLang workers N")
    ap.add_argument("--corpus-tokens", type=int, default=32768)
    ap.add_argument("--fractions", default="0.25,0.5,1,2", help="corpus / K")
    ap.add_argument("--sides", default="stock,corpusd")
    ap.add_argument("--concurrency", default="8,32,128", help="clients per worker")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per session")
    ap.add_argument("--sessions-each", type=int, default=1, help="sessions per client a trial")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--client-procs", type=int, default=0,
        help="load-generator processes the clients are dealt over (0: 2 per worker, at most "
        "half the cores; 1: threads of this process)",
    )  # fmt: skip
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--device", default="cuda:0", help="the holder's device")
    ap.add_argument(
        "--gpus", type=int, default=1,
        help="deal the workers over this many GPUs (worker i on GPU i mod G, both sides); "
        "1: every worker on --device's GPU",
    )  # fmt: skip
    ap.add_argument(
        "--pin-engine", action="store_true",
        help="pin the corpus through a stock SGLang server in capture mode (corpusd pin "
        "--engine), so route attends stock's own pages; default: corpusd's GPU prefill",
    )  # fmt: skip
    ap.add_argument(
        "--spread", action="store_true",
        help="with --gpus G: one holder on each of the G GPUs, the one copy split evenly over "
        "them (each worker reads a 1/G share from its own GPU, the rest over NVLink from "
        "G-1 peers) instead of the whole copy on --device's GPU",
    )  # fmt: skip
    ap.add_argument(
        "--index-arith", choices=("exact", "fp8"), default="fp8",
        help="the model's indexer arithmetic when --work has none yet (fp8: SGLang's)",
    )  # fmt: skip
    ap.add_argument("--mem-fraction", type=float, default=0.25)
    ap.add_argument("--graph-bs", default="8,32,128")
    ap.add_argument("--port", type=int, default=30200)
    ap.add_argument(
        "--over-budget",
        action="store_true",
        help="where the pinned copy leaves no room at equal HBM, run corpusd with stock's K per "
        "worker anyway (marked equal_hbm: false): is the corpus served at all",
    )
    ap.add_argument(
        "--route-alt-env", default="",
        help="KEY=VALUE[,KEY=VALUE]: after the corpusd side, run it again at each point with "
        "these plugin variables (e.g. CORPUSD_SGLANG_STAGE_ROWS=0), the same stock beside "
        "both; the JSON's point['corpusd_alt']",
    )  # fmt: skip
    ap.add_argument("--merge", nargs="+", default=[], help="result JSONs to merge into --out")
    a = ap.parse_args(argv)
    try:
        alt_env = parse_env(a.route_alt_env)
    except ValueError as e:
        ap.error(f"--route-alt-env: {e}")
    if a.gpus < 1:
        ap.error(f"--gpus {a.gpus}: at least 1")
    if a.spread and a.gpus < 2:
        ap.error("--spread: the holders go one on each GPU, so it needs --gpus 2 or more")
    if a.merge:
        return merge(a.merge, a.out)

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        from corpusd.model.tiny import init_tiny

        init_tiny(
            model,
            seed=20261127,
            preset="sglang",
            num_attention_heads=a.heads,
            num_hidden_layers=a.layers,
            hidden_size=a.hidden,
            index_topk=2048,
            mlp_layer_types=("dense",) + ("sparse",) * (a.layers - 1),
            # the pin selects with SGLang's fp8 index arithmetic, so that the pinned rows are
            # stock's and the exactness probe compares like with like
            index_arith=a.index_arith,
        )
    cfg = json.loads((model / "config.json").read_text())
    b = pool_bytes(cfg)
    vocab = int(cfg["vocab_size"])
    src = stdlib_corpus(work / "src", a.corpus_tokens - 1)  # + the BOS
    asks = questions(src, 4096)
    name = "shared"
    fractions = [float(f) for f in a.fractions.split(",")]
    holders, holder_devices, cap = holder_layout(a.corpus_tokens, a.device, a.gpus, a.spread)
    cd = pin_shared(a, work / f"corpusd-{os.getpid()}", model, name, src, holders,
                    holder_devices, cap)  # fmt: skip
    out: dict[str, Any] = {
        "command": "python -m tools.bench_share " + " ".join(argv or sys.argv[1:]),
        "gpu": gpu_name(),
        "servers": a.servers,
        "client_procs": client_procs(a.client_procs, a.servers),
        "devices": holder_devices.split(","),  # the holders'
        "pinned_by": "sglang (capture backend)" if a.pin_engine else "corpusd",
        "holder_capacity_tokens": cap,
        "worker_gpus": [i % a.gpus for i in range(a.servers)] if a.gpus > 1 else [a.device],
        "model": {
            k: cfg[k]
            for k in (
                "num_attention_heads",
                "num_hidden_layers",
                "hidden_size",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "index_head_dim",
                "index_topk",
                "index_arith",
            )
            if k in cfg
        },
        "sglang_pool_bytes_per_token": b,
        "route_staging": staging(cfg, a.gpus > 1),
        "flags_differing_from_sglang_defaults": WHY_FLAGS,
        "sglang_flags": sglang_flags(),
        "corpus": "Python stdlib source (byte tokens)",
        "points": [],
    }
    try:
        tokens = cd.tokens[name]
        held = cd.residency(model, "plain", a.device)
        holder_bytes = float(sum(v for v in held["bytes_resident"].values() if v))
        out.update(corpus_tokens=len(tokens), holder_bytes=holder_bytes, residency=held)
        tok = ByteTokenizer()
        suffixes = [tok.encode(q) for q in asks]
        for f in fractions:
            k = int(len(tokens) / f)
            k_route = route_budget(k, a.servers, holder_bytes, b)
            point: dict[str, Any] = {"fraction": f, "k_tokens": k, "k_route_tokens": k_route}
            print(f"== corpus {len(tokens)} tokens = {f:g} K: K={k}, K_route={k_route}", flush=True)
            if "stock" in a.sides:
                prompts = [tokens + s for s in suffixes]
                if len(tokens) + 64 + a.tokens > k:
                    point["stock"] = {
                        "k_tokens": k,
                        "started": False,
                        "error": f"a session needs ≥ {len(tokens) + a.tokens} "
                        f"tokens (the corpus and its answer) > K = {k}: "
                        "stock cannot hold the corpus and one session",
                    }
                else:
                    point["stock"] = run_side(a, "stock", model, cd, k, name, prompts, work, vocab)
            if "corpusd" in a.sides:
                if k_route < 64 + a.tokens:
                    why = (
                        f"the pinned copy ({holder_bytes / 2**20:.0f} MiB) leaves {k_route} "
                        "tokens a worker at equal HBM"
                    )
                    if a.over_budget:  # served at all: each worker gets stock's K besides
                        point["corpusd"] = run_side(
                            a, "route", model, cd, k, name, suffixes, work, vocab, stock_ref(point)
                        )
                        point["corpusd"]["equal_hbm"] = False
                        point["corpusd"]["why_not_equal"] = why
                    else:
                        point["corpusd"] = {"k_tokens": k_route, "started": False, "error": why}
                else:
                    point["corpusd"] = run_side(
                        a, "route", model, cd, k_route, name, suffixes, work, vocab,
                        stock_ref(point),
                    )  # fmt: skip
            if alt_env and "corpusd" in a.sides and k_route >= 64 + a.tokens:
                print(f"  (corpusd again with {alt_env})", flush=True)
                point["corpusd_alt"] = run_side(
                    a, "route", model, cd, k_route, name, suffixes, work, extra_env=alt_env
                )
                alt = point["corpusd_alt"].get("headline", {}).get("tokens_per_s_saturation")
                base_sat = point.get("stock", {}).get("headline", {}).get(
                    "tokens_per_s_saturation")  # fmt: skip
                if alt and base_sat:
                    point["corpusd_alt_over_stock_saturation"] = alt / base_sat
            vectors = {s: point.get(s, {}).pop("_probe", (None, None))[1] for s in SIDES}
            if any(vectors.values()):
                point["exactness"] = exactness(vectors["stock"], vectors["corpusd"])
            sat = {
                s: point.get(s, {}).get("headline", {}).get("tokens_per_s_saturation")
                for s in ("stock", "corpusd")
            }
            if sat["stock"] and sat["corpusd"]:
                point["corpusd_over_stock_saturation"] = sat["corpusd"] / sat["stock"]
            out["points"].append(point)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(out, indent=1))
    finally:
        cd.stop()
    plot(out, Path(a.out).with_suffix(".png"))
    print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
