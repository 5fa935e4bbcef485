"""A live SGLang server with corpusd, end to end (issue 7; ``pytest -m sglang``).

Runs ``tools/bench_sglang.py`` in a subprocess with short settings. The script pins a dense and a
sparse corpus on GPU holders and serves the tiny DeepSeek-V3.2 three ways in turn, each with a
real ``sglang.launch_server``: stock, route (the plugin) and fetch (the HiCache backend). This
test holds the script's JSON to what the issue claims:

- the tiny checkpoint is fitted to this repo's text first (``--fit-steps``), so its answers differ
  per question and depend on the corpus (its indexer is trained too, as DSA's warm-up does);
- route (given only the questions) is held to stock's teacher-forced predictions, and to fetch's
  (the same pinned pages moved into SGLang): free-running greedy tokens as faithful as fetch's;
- dense regime (every key attended, no top-k selection anywhere, so every mode attends exactly
  the same keys): route and fetch predict what stock SGLang predicts, within bf16 noise;
- sparse regime (top-2048 of 3,626 corpus keys): the corpus is pinned with SGLang's fp8 indexer
  arithmetic (``--index-arith fp8``, the script's default), so route and fetch select SGLang's
  keys and their teacher-forced next tokens agree with stock's, bar indexer near-ties.

Skipped with the reason without sglang or an SM90 GPU; it never runs in CPU CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.checks import why_no_sglang_gpu

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(bool(why_no_sglang_gpu()), reason=why_no_sglang_gpu()),
]

ROOT = Path(__file__).resolve().parents[2]
# the script's --requests, --tokens, --forced-steps: those of bench/results/sglang-h200.json, so
# one run is both this test and the committed result (CORPUSD_SGLANG_JSON keeps its JSON)
REQUESTS, TOKENS, FORCED = 8, 32, 8
# The tiny checkpoint fitted to this repo's text first (--fit-steps, on the GPU: 60 s), long
# enough that its answers differ per question and depend on the corpus (tools/flip_proxy.py on
# an H200: 8 of 8 distinct and corpus-dependent after 3,000 steps; the 200-step fit of session 6
# answered every question with the same run of spaces).
FIT_STEPS = 2000
PAGE = 64  # the script's --page-size
TIMEOUT_S = 1500  # three server starts (~30 s each on an H200) and a few hundred requests

# Dense bounds. The three modes attend the same keys, so only bf16 rounding separates them
# (corpusd's bf16 pages and Triton kernel against SGLang's own prefill and FlashMLA). Measured
# on an H200 with the 2,000-step fit: route 0.47 / fetch 0.50 max and 0.018 mean log-softmax
# abs diff over every vocabulary entry above -30 (the max sits in the tail: a fitted model's
# logits are large, and bf16 rounding scales with them; the random checkpoint gave 0.04 / 0.007).
# The mean bound sits 2.7× over that and 7× under the 0.365 measured when other keys were
# attended (the sparse regime with an exact pin, random weights).
MAX_LOGPROB_DIFF = 1.0
MAX_MEAN_LOGPROB_DIFF = 0.05
# A teacher-forced argmax may differ from stock's only at a near-tie: where stock's top two
# log-probs are closer than twice the measured noise (each moves by at most the max abs diff, so
# only such a pair can swap). Measured on an H200 with the 2,000-step fit: 63 of 64 per mode
# and regime (bench/results/sglang-h200.json); with a random indexer, sparse 59 (route) and 58
# (fetch) of 64 (bench/results/sglang-h200-fit2000-random-indexer.json). One bound, both regimes.
MIN_FORCED_AGREE = 0.85
# Route vs fetch: both attend corpusd's pinned pages, so this isolates route's own path (the
# holders' partials, the merge, the extended top-k) from how the pages were prefilled. Measured:
# mean 0.006 (dense) and 0.016 (sparse), teacher-forced 64 of 64 in both; with a random indexer
# 0.0049 and 0.038, 64 and 61 of 64.
MAX_MEAN_ROUTE_FETCH_DIFF = 0.1
# Free-running greedy tokens compound every flip: once the answers depend on the corpus, a
# near-tie comes every ~20 steps (3.5–7 % of greedy margins under 0.05 nats) and two correct
# bf16 paths part. Our own model, fp32 vs bf16 on an H200 (tools/flip_proxy.py, 3,000-step fit):
# 83 % (dense) and 54 % (sparse). The issue's >= 99 % is therefore not asserted. Route must be
# as faithful to stock as fetch, the move-the-cache baseline serving the same pinned pages,
# within GREEDY_SLACK; a route that attends other keys parts from stock at the first steps.
# Measured (2,000-step fit): route 71.5 % / fetch 71.5 % (dense, the same first divergences),
# 82 % / 89 % (sparse); with a random indexer 96.5 % / 100 % and 55 % / 53 %.
GREEDY_SLACK = 0.25
MIN_DISTINCT_ANSWERS = REQUESTS - 2  # stock's answers differ per question ...
MIN_CORPUS_DEPENDENT = REQUESTS - 2  # ... and change when the corpus is dropped (measured:
# 6–7 distinct and 8 dependent of 8)


def _near_ties_only(c: dict[str, Any], where: str) -> None:
    """Every teacher-forced argmax that differs from stock's is a near-tie the noise explains."""
    margins = c["ref_top2_margin_where_forced_differs"]
    noise = c["logprob_max_abs_diff"]
    assert all(m < 2 * noise for m in margins), f"{where}: margins {margins}, noise {noise}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 80) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def run_bench(tmp_path: Path) -> tuple[int, dict[str, Any], str]:
    """The script's exit code, its JSON and the tail of its output."""
    out, log = tmp_path / "sglang.json", tmp_path / "bench.log"
    cmd = [
        sys.executable, "-m", "tools.bench_sglang", "--out", str(out),
        "--work", str(tmp_path / "work"), "--regimes", "dense,sparse",
        "--requests", str(REQUESTS), "--tokens", str(TOKENS), "--forced-steps", str(FORCED),
        "--holder-device", "cuda:0", "--port", str(_free_port()), "--fit-steps", str(FIT_STEPS),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f:
        # Its own session, so whatever it leaves behind (servers, holders) can be ended by group.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # its finally blocks stop the servers and daemons
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(120)
            code = -1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = f"{_tail(log)}\n(server logs: {tmp_path / 'work'}/sglang-<mode>.log)"
    if code == -1:
        pytest.fail(f"bench_sglang ran past {TIMEOUT_S} s:\n{tail}")
    if not out.exists():
        pytest.fail(f"bench_sglang wrote no {out.name} (exit {code}):\n{tail}")
    if keep := os.environ.get("CORPUSD_SGLANG_JSON"):
        shutil.copyfile(out, keep)
        shutil.copyfile(log, Path(keep).with_suffix(".log"))
    return code, json.loads(out.read_text()), tail


def _check_ran(regime: dict[str, Any], name: str) -> None:
    """Every mode produced what the comparison needs, so the bounds cannot hold vacuously."""
    assert set(regime["vs_stock"]) == {"route", "fetch"}, f"{name}: {regime['vs_stock'].keys()}"
    assert "route_vs_fetch" in regime, name
    assert set(regime["tokens"]) == {"stock", "route", "fetch"}, (
        f"{name}: {regime['tokens'].keys()}"
    )
    for mode, tokens in regime["tokens"].items():
        assert [len(t) for t in tokens] == [TOKENS] * REQUESTS, f"{name=}, {mode=}: {tokens}"
    for mode, c in regime["vs_stock"].items():
        assert c["forced_steps"] == REQUESTS * FORCED, f"{name=}, {mode=}: {c['forced_steps']=}"
    # Fetch given the full prompt equals stock trivially if the HiCache backend served nothing;
    # SGLang's cached_tokens shows the corpus's whole pages loaded, on the first request too.
    whole = regime["corpus_tokens"] // PAGE * PAGE
    cached = regime["cached_tokens"]["fetch"]
    assert whole > 0 and all(c is not None and c >= whole for c in cached), f"{name}: {cached=}"


def test_live_server_route_and_fetch_predict_what_stock_predicts(
    tmp_path: Path,
) -> None:
    code, res, tail = run_bench(tmp_path)
    assert res["failed"] == {}, f"{res['failed']}\n{tail}"
    assert code == 0, tail
    assert set(res["regimes"]) == {"dense", "sparse"}, res["regimes"].keys()
    topk = res["index_topk"]
    dense, sparse = res["regimes"]["dense"], res["regimes"]["sparse"]
    # the regimes are what their names say, or the bounds below test the wrong thing
    assert dense["prompt_tokens_max"] <= topk < sparse["corpus_tokens"], (topk, dense, sparse)
    _check_ran(dense, "dense")
    _check_ran(sparse, "sparse")
    _check_answers(dense, "dense")
    _check_answers(sparse, "sparse")
    for name, regime in (("dense", dense), ("sparse", sparse)):
        assert set(regime["concurrent"]) == {"stock", "route", "fetch"}, (name, regime.keys())
        assert set(regime["batched_vs_sequential"]) == {"stock", "route", "fetch"}, name

    # Route is given only the questions: it can agree with stock only by attending the corpus
    # through the holders.
    for mode in ("route", "fetch"):
        c = dense["vs_stock"][mode]
        summary = {k: v for k, v in c.items() if k != "first_divergence"}
        assert c["forced_agree"] >= MIN_FORCED_AGREE, f"dense, {mode=} vs stock: {summary}"
        _near_ties_only(c, f"dense, {mode=} vs stock")
        assert c["logprob_max_abs_diff"] <= MAX_LOGPROB_DIFF, f"dense, {mode=} vs stock: {summary}"
        assert c["logprob_mean_abs_diff"] <= MAX_MEAN_LOGPROB_DIFF, (
            f"dense, {mode=} vs stock: {summary}"
        )
        c = sparse["vs_stock"][mode]
        summary = {k: v for k, v in c.items() if k != "first_divergence"}
        assert res["index_arith"] == "fp8"
        assert c["forced_agree"] >= MIN_FORCED_AGREE, f"sparse, {mode=} vs stock: {summary}"
        _near_ties_only(c, f"sparse, {mode=} vs stock")
    for name, regime in (("dense", dense), ("sparse", sparse)):
        c = regime["route_vs_fetch"]
        summary = {k: v for k, v in c.items() if k != "first_divergence"}
        assert c["forced_agree"] >= MIN_FORCED_AGREE, f"{name}, route vs fetch: {summary}"
        assert c["logprob_mean_abs_diff"] <= MAX_MEAN_ROUTE_FETCH_DIFF, (
            f"{name}, route vs fetch: {summary}"
        )
        route, fetch = (regime["vs_stock"][m] for m in ("route", "fetch"))
        assert route["greedy_agree"] >= fetch["greedy_agree"] - GREEDY_SLACK, (
            f"{name}, free-running vs stock: route {route['greedy_agree']} (first divergences "
            f"{route['first_divergence']}), fetch {fetch['greedy_agree']}"
        )


def _check_answers(regime: dict[str, Any], name: str) -> None:
    """The free-running comparison means something only if stock's answers need the corpus."""
    ans = regime["stock_answers"]
    assert ans["distinct"] >= MIN_DISTINCT_ANSWERS, f"{name}: {ans}"
    assert ans["corpus_dependent"] >= MIN_CORPUS_DEPENDENT, f"{name}: {ans}"
