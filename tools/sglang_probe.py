"""Requests a route server cannot bind (issue 17, item 4), for ``tools/bench_sglang.py``: each
must fail alone with a clear message, fast, while the server serves every other request."""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from requester.sglang.binding import request_fields
from tools.sglang_server import Server, request


def binding_probe(
    server: Server, corpus: str, prompt: list[int], vocab: int,
    corpus_tokens: list[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Requests the plugin cannot bind (an unknown corpus, a malformed id, and with
    ``corpus_tokens`` a bound prompt that repeats its corpus) must each fail alone with a clear
    message, and the server must go on serving (issue 17, item 4)."""
    out: dict[str, Any] = {}
    bad: dict[str, tuple[dict[str, str], list[int]]] = {
        "unknown corpus": (request_fields("no-such-corpus", "probe"), prompt),
        "malformed id": ({"rid": f"corpusd:{corpus}"}, prompt),
    }
    if corpus_tokens is not None:  # the corpus sent along: it would be attended twice
        bad["repeats its corpus"] = (request_fields(corpus, "probe-repeat"), corpus_tokens + prompt)
    for label, (fields, ids) in bad.items():
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            **fields,
        }
        try:
            meta = server.post(body, timeout=120)["meta_info"]
            out[label] = {"http": 200, "finish_reason": meta.get("finish_reason")}
        except urllib.error.HTTPError as e:
            out[label] = {"http": e.code, "body": e.read().decode(errors="replace")[:500]}
    after = server.post(request(prompt, 4, "route", corpus, 10**6, vocab, False), timeout=120)
    out["after"] = {"tokens": len(after["output_ids"]), "server_alive": server.proc.poll() is None}
    return out


def concurrent_probe(
    server: Server, corpus: str, prompts: list[list[int]], vocab: int, tokens: int = 8
) -> dict[str, Any]:
    """The issue's bad-input check: ``len(prompts)`` good requests at once, alone and then with
    one bound to an unknown corpus sent among them. The bad one must get its error within 1 s;
    the good ones the tokens they got alone; the server must stay up."""

    def good(i: int) -> list[int]:
        body = request(prompts[i], tokens, "route", corpus, i, vocab, False, phase="probe")
        return list(server.post(body, timeout=300)["output_ids"])

    def bad() -> dict[str, Any]:
        body = {
            "input_ids": prompts[0],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens},
            **request_fields("no-such-corpus", f"probe-{time.monotonic_ns()}"),
        }
        t0 = time.monotonic()
        try:
            server.post(body, timeout=60)
            return {"http": 200, "s": time.monotonic() - t0}
        except urllib.error.HTTPError as e:
            return {"http": e.code, "s": time.monotonic() - t0, "body": e.read().decode()[:300]}

    n = len(prompts)
    with ThreadPoolExecutor(n + 1) as pool:
        alone = list(pool.map(good, range(n)))
        futures = [pool.submit(good, i) for i in range(n)]
        time.sleep(0.05)  # the bad request arrives while the good ones are in flight
        refused = bad()
        together = [f.result() for f in futures]
    return {
        "bad": refused,
        "good_same_tokens": sum(a == b for a, b in zip(alone, together, strict=True)),
        "good": n,
        "server_alive": server.proc.poll() is None,
    }


def first_token(
    server: Server, mode: str, corpus: str, prompts: list[list[int]], vocab: int, n: int = 4
) -> dict[str, Any]:
    """Time to first token of single requests on an otherwise idle server (issue 17), each
    twice: right after ``/flush_cache`` (**cold**: stock prefills the corpus with the question;
    route prefills the question only, the corpus staying on the holders) and again at once
    (**warm**: stock's radix cache holds the corpus). Medians over the first ``n`` prompts,
    ms; each request asks for 2 tokens and is streamed, so the first chunk is the first token."""
    from tools.pin_sglang import flush

    cold: list[float] = []
    warm: list[float] = []
    for i, p in enumerate(prompts[:n]):
        flush(server.url)
        for into in (cold, warm):
            t0 = time.monotonic()
            times, _ = server.stream(request(p, 2, mode, corpus, 300 + i, vocab, False))
            into.append((times[0] - t0) * 1e3)
    med = statistics.median
    return {"requests": len(cold), "cold_p50_ms": med(cold), "warm_p50_ms": med(warm),
            "cold_ms": cold, "warm_ms": warm}  # fmt: skip


def first_token_score(stock: dict[str, Any], route: dict[str, Any]) -> dict[str, Any]:
    """Issue 17's first-token targets: route's (cold: it never holds the corpus in its radix
    cache) within 1.5× stock's warm, and below stock's cold."""
    warm = route["cold_p50_ms"] / stock["warm_p50_ms"]
    cold = route["cold_p50_ms"] / stock["cold_p50_ms"]
    return {"route_over_stock_warm": round(warm, 3), "within_1_5x_warm": warm <= 1.5,
            "route_over_stock_cold": round(cold, 3), "below_stock_cold": cold < 1.0}  # fmt: skip


def concurrent(
    server: Server, mode: str, corpus: str, prompts: list[list[int]], streams: int,
    n_tokens: int, vocab: int,
) -> dict[str, Any]:  # fmt: skip
    """``streams`` concurrent streamed requests (the prompts in turn), timed client-side, with
    SGLang's KV-pool use sampled; their tokens are the prompts' greedy answers in one batch."""
    peak = [server.used_tokens()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(server.used_tokens())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    chosen = [prompts[i % len(prompts)] for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.monotonic()
        futs = [
            pool.submit(server.stream, request(p, n_tokens, mode, corpus, 100 + i, vocab, False))
            for i, p in enumerate(chosen)
        ]
        arrivals, batched = zip(*(f.result() for f in futs), strict=True)
    stop.set()
    sampler.join()
    gaps = [b - a for t in arrivals for a, b in itertools.pairwise(t)]
    adjusted = [g for t in arrivals for g in burst_gaps(t)]
    ttft = [t[0] - t0 for t in arrivals if t]
    # time per output token, per request (first token to last over the gaps): robust to tokens
    # that arrive in bursts, where the median gap is ~0 (stock at 64 streams: 0.1 ms)
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in arrivals if len(t) > 1]
    return {
        "streams": streams,
        "tokens_each": n_tokens,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "inter_token_p50_ms": 1e3 * statistics.median(gaps),
        "inter_token_p90_ms": 1e3 * statistics.quantiles(gaps, n=10)[-1],
        # each burst's gap shared by its tokens, as SGLang's own inter-token histogram counts
        "inter_token_burst_adjusted_p50_ms": 1e3 * statistics.median(adjusted),
        "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
        "kv_pool_peak_tokens": max(v for v in peak if not math.isnan(v)),
        "tokens": list(batched[: len(prompts)]),
    }


def burst_gaps(arrivals: list[float], within_s: float = 2e-4) -> list[float]:
    """One request's inter-token gaps with bursts undone: chunks that reach the client within
    ``within_s`` of the previous one form a burst (the server wrote them together, or the client
    read them together), and the gap before a burst of ``k`` tokens counts as ``k`` gaps of
    ``gap / k``, as SGLang's own inter-token histogram counts a chunk of ``k`` new tokens
    (``observe_inter_token_latency``). Tokens that come with the first are not gaps. The median
    of these compares servers whose tokens arrive in bursts of different sizes, where the raw
    gaps' median is ~0 once most tokens come in bursts."""
    bursts: list[list[float]] = []  # [first arrival, last arrival, tokens]
    for t in arrivals:
        if bursts and t - bursts[-1][1] <= within_s:
            bursts[-1][1], bursts[-1][2] = t, bursts[-1][2] + 1
        else:
            bursts.append([t, t, 1])
    out: list[float] = []
    for prev, cur in itertools.pairwise(bursts):
        out += [(cur[0] - prev[1]) / cur[2]] * int(cur[2])
    return out
