"""tools/bench_sglang.py's arithmetic (tools/sglang_compare.py) on synthetic runs: the plugin
predicate's score against forced route and fetch, route vs fetch exactness, the modes
``--primitive`` makes (CPU; no sglang, no server)."""

from __future__ import annotations

import argparse
import json
import math
import types
from pathlib import Path
from typing import Any

import pytest

from corpusd.tokenizer import BOS_ID, ByteTokenizer
from tools.bench_sglang import QUESTIONS, greedy_tag, question_suffixes, request, summarize
from tools.layer_compare import selection_bar
from tools.sglang_compare import (
    against_floor,
    check_modes,
    compare,
    corpus_kl,
    exactness,
    forced_compare,
    forced_primitive,
    free_running,
    is_route,
    kl,
    load_trace,
    mode_tag,
    noise_floor,
    over_trials,
    predicate_score,
    primitive_modes,
    report,
    variant_env,
    where_corpus_matters,
)
from tools.sglang_compare import main as compare_main


def test_primitive_modes() -> None:
    modes = ["stock", "route", "fetch"]
    assert primitive_modes(modes, []) == modes  # no flag: unchanged
    assert primitive_modes(modes, ["route", "fetch", "auto"]) == [
        "stock", "route@route", "route@fetch", "route@auto", "fetch",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="distinct ones of"):
        primitive_modes(modes, ["route", "local"])
    with pytest.raises(ValueError, match="needs route"):
        primitive_modes(["stock"], ["auto"])


def test_route_variants_are_route_modes_with_a_plugin_setting() -> None:
    check_modes(["stock", "route", "route+one", "fetch", "route@auto"])
    assert is_route("route+one") and forced_primitive("route+one") is None
    assert variant_env("route+one") == {"CORPUSD_SGLANG_ONE_CALL": "1"}
    assert variant_env("route") == {} and variant_env("route@fetch") == {}
    assert mode_tag("route+one") == "route-one" and mode_tag("route@fetch") == "route-fetch"
    with pytest.raises(ValueError, match="unknown mode 'route\\+two'"):
        check_modes(["stock", "route+two"])
    with pytest.raises(ValueError, match="given twice"):
        check_modes(["stock", "route", "route"])


def test_an_unknown_mode_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from tools.bench_sglang import main

    with pytest.raises(SystemExit) as e:
        main(["--modes", "stock,rout", "--work", str(tmp_path / "w")])
    assert e.value.code == 2 and not (tmp_path / "w").exists()


def _rid(mode: str, corpus: str, i: int) -> str:
    """The rid the bench gives a sequential greedy request (its own function, not a copy)."""
    return request([1], 1, mode, corpus, i, 8, False, greedy_tag(corpus))["rid"]


def _trace(mode: str, costs: dict[int, float], pick: Any, first_step: int) -> list[dict]:
    """Two greedy requests of 3 forwards each, 2 layers, one holder; a batched forward of
    two requests in between (the concurrent phase), which scoring must ignore."""
    out, step = [], first_step
    for i in range(2):
        rid = _rid(mode, "sparse", i)
        for f in range(3):
            step += 1
            for layer in range(2):
                entry = {"step": step, "rids": [rid], "layer": layer, "holder": "h:1"}
                out.append({**entry, "pick": pick(f), "measured_us": costs[f], "predicted_us": {}})
    out.append({"step": step + 1, "rids": [_rid(mode, "sparse", 0), _rid(mode, "sparse", 1)],
                "layer": 0, "holder": "h:1", "pick": "route", "measured_us": 1e9,
                "predicted_us": {}})  # fmt: skip
    return out


def test_predicate_score_matches_groups_across_runs() -> None:
    route = _trace("route@route", {0: 100.0, 1: 100.0, 2: 100.0}, lambda f: "route", 0)
    fetch = _trace("route@fetch", {0: 300.0, 1: 50.0, 2: 50.0}, lambda f: "fetch", 7)
    # auto: route while pages are missing, then fetch; its server counted other steps first
    auto = _trace("route@auto", {0: 110.0, 1: 55.0, 2: 55.0},
                  lambda f: "route" if f == 0 else "fetch", 40)  # fmt: skip
    s = predicate_score({"route": route, "fetch": fetch, "auto": auto}, greedy_tag("sparse"))
    assert s["groups"] == 2 * 3 * 2 and s["right"] == 12 and s["share_right"] == 1.0
    assert s["auto_picks"] == {"route": 4, "fetch": 8}
    assert s["measured_us_total"] == {"route": 1200.0, "fetch": 1600.0, "auto": 880.0}
    assert s["auto_within_slack"] and s["auto_over_better_forced"] == pytest.approx(880 / 1200)
    # auto always routing is right only where route measured cheaper, and 10 % slower fails
    slow = _trace("route@auto", {0: 140.0, 1: 140.0, 2: 140.0}, lambda f: "route", 0)
    s = predicate_score({"route": route, "fetch": fetch, "auto": slow}, greedy_tag("sparse"))
    assert s["right"] == 4 and len(s["wrong_examples"]) == 8 and not s["auto_within_slack"]
    # another corpus's requests are other groups
    assert (
        predicate_score({"route": route, "fetch": fetch, "auto": auto}, "greedy-dense-")["groups"]
        == 0
    )


def test_load_trace_reads_json_lines(tmp_path: Path) -> None:
    assert load_trace(tmp_path / "none.jsonl") == []
    (tmp_path / "t.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n{"st')
    assert load_trace(tmp_path / "t.jsonl") == [{"step": 1}, {"step": 2}]  # last: being written
    (tmp_path / "bad.jsonl").write_text('{"st\n{"step": 2}\n')
    with pytest.raises(ValueError):
        load_trace(tmp_path / "bad.jsonl")


def _run(vectors: list[list[list[float]]]) -> dict[str, Any]:
    return {"greedy": [{"tokens": [1, 2]}], "forced": vectors}


def test_first_divergences_carry_both_sides_top2_margins() -> None:
    """Issue 18: every free-running divergence listed with stock's and route's top-2 margin at
    the step where they parted (a near-tie under 0.05 nats is noise, a wide one is a defect)."""
    stock: dict[str, list[Any]] = {
        "greedy": [{"tokens": [1, 2, 0]}, {"tokens": [0, 0, 0]}, {"tokens": [2, 2, 2]}],
        "forced": [
            [[-0.1, -2.5, -9.0], [-0.70, -0.69, -9.0], [-0.1, -3.0, -9.0]],  # step 1: near tie
            [[-0.1, -2.5, -9.0]] * 3,
            [[-5.0, -5.0, -0.01]] * 2,  # 2 forced steps: a divergence at step 2 has no margin
        ],
    }
    route: dict[str, list[Any]] = {
        "greedy": [{"tokens": [1, 0, 0]}, {"tokens": [0, 0, 0]}, {"tokens": [2, 2, 1]}],
        "forced": [
            [[-0.1, -2.5, -9.0], [-0.69, -0.70, -9.0], [-0.1, -3.0, -9.0]],
            [[-0.1, -2.5, -9.0]] * 3,
            [[-5.0, -5.0, -0.01]] * 2,
        ],
    }
    d = compare(stock, route)["divergences"]
    assert d["rows"] == [
        {"request": 0, "step": 1, "stock_top2_margin": 0.01, "got_top2_margin": 0.01},
        {"request": 2, "step": 2, "stock_top2_margin": None, "got_top2_margin": None},
    ]
    assert not d["all_near_ties"]  # one divergence has no margin to judge
    two = {k: v[:2] for k, v in stock.items()}
    got = {k: v[:2] for k, v in route.items()}
    assert compare(two, got)["divergences"]["all_near_ties"]
    wide = {**got, "greedy": [{"tokens": [0, 2, 0]}, {"tokens": [0, 0, 0]}]}
    far = compare(two, wide)["divergences"]
    assert far["rows"][0]["stock_top2_margin"] == 2.4 and not far["all_near_ties"]


def test_exactness_counts_every_teacher_forced_step() -> None:
    a = _run([[[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]])
    close = _run([[[-0.11, -2.49, -9.01], [-3.0, -0.07, -4.0]]])
    e = exactness(a, close)
    assert e["forced_agree_steps"] == e["forced_steps"] == 2 and e["ok"]
    assert e["logprob_mean_abs_diff"] == pytest.approx((0.01 + 0.01 + 0.01 + 0.01) / 6)
    flipped = _run([[[-2.5, -0.1, -9.0], [-3.0, -0.06, -4.0]]])
    assert exactness(a, flipped)["forced_agree_steps"] == 1 and not exactness(a, flipped)["ok"]
    far = _run([[[-0.1, -2.0, -9.0], [-3.0, -0.06, -4.2]]])
    assert not exactness(a, far)["ok"]  # the argmax agrees, the mean diff is past 0.02


def test_report_prints_the_primitive_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary table of a run with --primitive (the bench prints it after saving JSON)."""
    a = _run([[[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]])
    route = _trace("route@route", {0: 100.0, 1: 100.0, 2: 100.0}, lambda f: "route", 0)
    fetch = _trace("route@fetch", {0: 300.0, 1: 50.0, 2: 50.0}, lambda f: "fetch", 0)
    score = predicate_score({"route": route, "fetch": fetch, "auto": route}, greedy_tag("sparse"))
    score.update(inter_token_p50_ms={"route": 9.0, "fetch": 6.0, "auto": 6.3},
                 auto_itl_over_better_forced=1.05)  # fmt: skip
    c = compare(a, a)
    conc = {"ttft_p50_ms": 50.0, "inter_token_p50_ms": 6.0, "tpot_p50_ms": 6.25,
            "kv_pool_peak_tokens": 100.0}  # fmt: skip
    out = {"regimes": {"sparse": {
        "vs_stock": {"route@fetch": c},
        "batched_vs_sequential": {"stock": free_running([[1]], [[1]])},
        "primitive_exactness": exactness(a, a), "predicate": score,
        "stock_answers": {"distinct": 8, "corpus_dependent": 8, "text": ["a", "b"]},
        "concurrent_by_streams": {"route@auto": {"8": conc}},
        "first_token": {"stock": {"cold_p50_ms": 400.0, "warm_p50_ms": 50.0}},
        "first_token_score": {"within_1_5x_warm": True},
    }}}  # fmt: skip
    report(out)
    text = capsys.readouterr().out
    assert "route vs fetch (plugin) teacher-forced 2/2, mean |Δ log-prob| 0.0000 (ok" in text
    # auto always routed: right where route measured cheaper, and its total is route's
    assert "predicate right 4/12 groups" in text and "auto / better forced 1.0 (within 10 %" in text
    assert "auto / better forced 1.050" in text and "route@auto       8" in text
    assert "tpot p50 ms" in text and "       6.25    100" in text
    assert "stock first token p50, idle server: cold 400.0 ms (after /flush_cache)" in text
    assert "first token targets {'within_1_5x_warm': True}" in text


def test_first_token_is_timed_cold_after_a_flush_then_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 17's first-token probe: each prompt right after /flush_cache, then again; the
    targets compare route's cold time with stock's warm (1.5x) and cold (below)."""
    import tools.pin_sglang as pin_sglang
    from tools import sglang_probe

    events: list[str] = []
    monkeypatch.setattr(pin_sglang, "flush", lambda url: events.append(f"flush {url}"))

    class Stub:
        url = "http://stub"

        def __init__(self) -> None:
            self.n = 0

        def stream(self, body: dict[str, Any]) -> tuple[list[float], list[int]]:
            import time

            self.n += 1
            events.append(f"req {body['input_ids'][0]}")
            first = time.monotonic() + (0.02 if self.n % 2 else 0.002)  # cold, then warm
            return [first, first + 0.01], [1, 2]

    got = sglang_probe.first_token(Stub(), "stock", "c", [[7], [8], [9]], 16, n=2)  # type: ignore[arg-type]
    assert events == ["flush http://stub", "req 7", "req 7", "flush http://stub", "req 8", "req 8"]
    assert got["requests"] == 2 and got["cold_p50_ms"] > 15 > 5 > got["warm_p50_ms"]
    score = sglang_probe.first_token_score(
        {"cold_p50_ms": 400.0, "warm_p50_ms": 50.0}, {"cold_p50_ms": 70.0}
    )
    assert score == {"route_over_stock_warm": 1.4, "within_1_5x_warm": True,
                     "route_over_stock_cold": 0.175, "below_stock_cold": True}  # fmt: skip
    assert not sglang_probe.first_token_score(
        {"cold_p50_ms": 60.0, "warm_p50_ms": 20.0}, {"cold_p50_ms": 70.0}
    )["within_1_5x_warm"]


def test_burst_gaps_share_a_bursts_gap_among_its_tokens() -> None:
    """Tokens every 4 ms, then three in one burst after 12 ms, then one 4 ms later: the burst's
    12 ms count as three 4 ms gaps; tokens that arrive with the first are no gaps; the raw gaps'
    median would be 0 for a stream that is all bursts."""
    from tools import sglang_probe

    ms = 1e-3
    t = [0.0, 0.0, 4 * ms, 8 * ms, 20 * ms, 20.05 * ms, 20.1 * ms, 24.1 * ms]
    got = sglang_probe.burst_gaps(t)
    want = [4 * ms, 4 * ms] + [12 * ms / 3] * 3 + [4 * ms]
    assert got == pytest.approx(want)
    assert sglang_probe.burst_gaps([]) == [] and sglang_probe.burst_gaps([1.0]) == []
    bursty = [i // 4 * 16 * ms + i % 4 * 1e-5 for i in range(16)]  # 4 tokens per 16 ms
    assert sglang_probe.burst_gaps(bursty) == pytest.approx([(16 * ms - 3e-5) / 4] * 12)


def test_noise_floor_and_route_against_it() -> None:
    """Issue 36, item 1: stock against itself (batched vs one at a time; a second server) on the
    same teacher-forced contexts, and route beside that floor and as a ratio to it."""
    s0 = [[[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]] * 2  # 2 requests × 2 steps
    seq = [[[-0.1, -2.6, -9.0], [-3.0, -0.06, -4.0]]] * 2  # max 0.1 (step 1 of each)
    two = [[[-0.1, -2.5, -9.0], [-3.2, -0.06, -4.0]], [[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]]
    stock = {**_run(s0), "forced_sequential": seq, "forced_restart": two}
    floors = noise_floor(stock)
    assert set(floors) == {"batched_vs_sequential", "two_servers"}
    b, t = floors["batched_vs_sequential"], floors["two_servers"]
    assert b["forced_agree_steps"] == 4 and b["logprob_max_abs_diff"] == pytest.approx(0.1)
    assert b["logprob_mean_abs_diff"] == pytest.approx(0.2 / 12)  # 12 entries above -30
    assert t["logprob_max_abs_diff"] == pytest.approx(0.2)
    assert noise_floor(_run(s0)) == {}  # no floor run: none reported
    # route: one step flipped, max 2.5 (12.5 × the noisiest floor's 0.2)
    r = [[[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]], [[-2.6, -0.1, -9.0], [-3.0, -0.06, -4.25]]]
    c = compare(_run(s0) | {"greedy": [{"tokens": [1, 2]}] * 2},
                _run(r) | {"greedy": [{"tokens": [1, 2]}] * 2})  # fmt: skip
    v = against_floor(c, floors)
    assert v["floors"]["two_servers"]["max_over_floor"] == pytest.approx(2.5 / 0.2)
    assert v["floors"]["batched_vs_sequential"]["agree_steps_minus_floor"] == -1
    nf = v["noisiest_floor"]
    assert nf["logprob_max_abs_diff"] == pytest.approx(0.2)
    assert nf["max_over_floor"] == pytest.approx(2.5 / 0.2)
    assert not v["within_floor"]["logprob"]  # 12.5 × is past 1.5 ×
    assert v["within_floor"]["forced_agree"]  # 3/4 ≥ 4/4 minus one step (the least slack)
    calm = compare(_run(s0), _run(two[:1] + s0[:1]))  # route equal to one floor
    w = against_floor(calm, floors)
    assert w["within_floor"] == {"logprob": True, "forced_agree": True}
    assert against_floor(calm, {})["floors"] == {} and "within_floor" not in against_floor(calm, {})
    exact = compare(_run(s0), _run(s0))
    zero = {"z": forced_compare(s0, s0)}
    assert against_floor(exact, zero)["noisiest_floor"]["max_over_floor"] == 1.0  # 0 / 0
    assert against_floor(c, zero)["noisiest_floor"]["max_over_floor"] is None  # x / 0


def test_route_trials_give_median_and_spread_and_read_the_bars_on_the_medians() -> None:
    """``--route-trials``: each fresh route server's forced figures against stock, then the
    median, min and max over the trials; one noisy trial of three does not move the medians."""
    s0 = [[[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]] * 2
    two = [[[-0.1, -2.5, -9.0], [-3.2, -0.06, -4.0]], [[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]]
    floors = noise_floor({**_run(s0), "forced_restart": two})  # max 0.2
    near = [[[-0.1, -2.5, -9.0], [-3.1, -0.06, -4.0]]] * 2  # max 0.1
    flip = [[[-2.6, -0.1, -9.0], [-3.0, -0.06, -4.0]], s0[0]]  # one argmax flipped, max 2.5
    got = over_trials(s0, [near, near, flip], floors)
    assert got["trials"] == 3 and got["forced_steps"] == 4 and len(got["per_trial"]) == 3
    st = got["stats"]
    assert st["logprob_max_abs_diff"]["median"] == pytest.approx(0.1)
    assert st["logprob_max_abs_diff"]["max"] == pytest.approx(2.5)
    assert st["forced_agree_steps"] == {"median": 4, "min": 3, "max": 4}
    assert st["max_over_floor"]["median"] == pytest.approx(0.5)
    assert got["within_floor_on_medians"] == {"logprob": True, "forced_agree": True}
    worse = over_trials(s0, [flip, flip, near], floors)
    assert worse["within_floor_on_medians"]["logprob"] is False
    assert "within_floor_on_medians" not in over_trials(s0, [near], {})


def test_report_prints_the_floor_lines(capsys: pytest.CaptureFixture[str]) -> None:
    s0 = [[[-0.1, -2.5, -9.0], [-3.0, -0.06, -4.0]]]
    seq = [[[-0.1, -2.6, -9.0], [-3.0, -0.06, -4.0]]]
    floors = noise_floor({**_run(s0), "forced_sequential": seq})
    c = compare(_run(s0), _run(seq))
    out = {"regimes": {"sparse": {
        "vs_stock": {"route": c}, "batched_vs_sequential": {},
        "noise_floor": floors, "vs_floor": {"route": against_floor(c, floors)},
        "stock_answers": {"distinct": 1, "corpus_dependent": 0, "text": ["a"],
                          "agreement_counts": False},
        "where_corpus_matters": {"route": where_corpus_matters(s0, seq, [[0.5, 2.0]], top=0.5)},
        "route_trials": over_trials(s0, [seq, s0, seq], floors),
    }}}  # fmt: skip
    report(out)
    text = capsys.readouterr().out
    assert "stock batched_vs_sequential forced 2/2, |Δ log-prob| max 0.1000" in text
    assert "fewer than 3 in 4 answers depend on the corpus" in text
    assert "route/stock where the corpus matters" in text
    assert "agree 1/1, |Δ log-prob| max 0.000 mean 0.0000 (corpus KL >= 2.00 nats)" in text
    assert "route/stock over floor" in text and "max ×1.0, mean ×1.0 (bar 1.5: ok)" in text
    assert "route, 3 servers" in text and "max ×1.00 [0.00–1.00]" in text and "forced 2/2" in text


def _logsoftmax(logits: list[float]) -> list[float]:
    z = math.log(sum(math.exp(x) for x in logits))
    return [x - z for x in logits]


def test_corpus_kl_ranks_the_positions_the_corpus_moves() -> None:
    flat = _logsoftmax([0.0, 0.0, 0.0])
    sure = _logsoftmax([9.0, 0.0, 0.0])
    assert kl(flat, flat) == 0.0
    assert kl(sure, flat) == pytest.approx(math.log(3), abs=0.01)  # near-certain vs uniform
    assert kl(flat, sure) > kl(sure, flat)  # not symmetric: a uniform p pays for sure's zeros
    assert kl(sure, [0.0, -math.inf, math.nan]) == pytest.approx(kl(sure, [0.0, -100.0, -100.0]))
    # request 0: the corpus matters at step 1; request 1: nowhere
    with_corpus = [[flat, sure], [flat, flat]]
    bare = [[flat, flat], [flat, flat]]
    kls = corpus_kl(with_corpus, bare)
    assert kls[0][1] > 1.0 and kls[0][0] == kls[1][0] == kls[1][1] == 0.0
    # a route that differs only where the corpus does not matter is clean there
    off = _logsoftmax([0.0, 0.5, 0.0])
    route = [[off, sure], [off, off]]
    m = where_corpus_matters(with_corpus, route, kls, top=0.25)
    assert m["forced_steps"] == 1 and m["corpus_kl_min_nats"] == kls[0][1]
    assert m["logprob_max_abs_diff"] == 0.0 and m["forced_agree"] == 1.0
    # and one that differs there is caught, however clean it is elsewhere
    wrong = [[flat, _logsoftmax([0.0, 9.0, 0.0])], [flat, flat]]
    m = where_corpus_matters(with_corpus, wrong, kls, top=0.25)
    assert m["forced_agree"] == 0.0 and m["logprob_max_abs_diff"] > 8.0
    assert forced_compare(with_corpus, wrong)["forced_agree"] == 0.75  # diluted over all


def test_span_questions_quote_each_pinned_corpus() -> None:
    text = ("def alpha_function(x):\n    return beta_value + x * 3\n" * 1) + "".join(
        f"line number {i} says something distinct about item {i * 7}\n" for i in range(60)
    )
    tokens = [BOS_ID, *ByteTokenizer().encode(text)]
    fixed = question_suffixes("fixed", tokens, 3)
    assert [ByteTokenizer().decode(s) for s in fixed] == [f"\n\nQ: {q}\nA:" for q in QUESTIONS[:3]]
    span = [ByteTokenizer().decode(s) for s in question_suffixes("span", tokens, 8)]
    assert len(set(span)) == 8
    for q in span:
        quote = q.removeprefix("\n\nQ: What follows?\nA: ")
        assert text.count(quote) == 1, q
    assert span == [ByteTokenizer().decode(s) for s in question_suffixes("span", tokens, 8)]


def test_summarize_reads_a_span_run_against_its_floors_where_the_corpus_matters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench's JSON from a stock and a route run (synthetic): the floors, the corpus KL per
    position, every mode and floor where the corpus matters, agreement_counts."""
    flat, sure = _logsoftmax([0.0, 0.0, 0.0]), _logsoftmax([0.0, 9.0, 0.0])
    surer, near = _logsoftmax([0.0, 10.0, 0.0]), _logsoftmax([0.0, 9.9, 0.0])

    def side(forced: list[list[list[float]]], **more: Any) -> dict[str, Any]:
        greedy = [{"tokens": [1, 1], "cached_tokens": 0}, {"tokens": [1, 2], "cached_tokens": 0}]
        timed = {"tokens": [[1, 1], [1, 2]], "ttft_p50_ms": 9.0, "inter_token_p50_ms": 1.0,
                 "kv_pool_peak_tokens": 64}  # fmt: skip
        return {"greedy": greedy, "forced": forced, "concurrent": timed,
                "concurrent_by_streams": {"8": timed}, **more}  # fmt: skip

    # request 0's first step is where the corpus matters most; route and a second stock server
    # differ from stock there by 0.1 nats
    stock = side([[surer, flat], [sure, flat]], bare=[[0, 0], [1, 2]],
                 forced_bare=[[flat, flat], [flat, flat]],
                 forced_restart=[[near, flat], [sure, flat]])  # fmt: skip
    route = side([[near, flat], [sure, flat]])
    a = argparse.Namespace(
        index_arith="fp8", fit_steps=0, pin_engine=False, requests=2, corpus="stdlib",
        questions="span", fit_task="lm", src_model="", tokens=2, holders=1, holder_device="cpu",
        no_cuda_graph=True, graph_bs=(), streams=(8,), kv_cache_dtype="auto", dump=False,
        work="/nonexistent", holder_capacity=16384, sglang_extra="",
    )  # fmt: skip
    cd = types.SimpleNamespace(tokens={"sparse": [BOS_ID, 65, 66]}, held={})
    sfx = {"sparse": [ByteTokenizer().encode("\n\nQ: What follows?\nA: AB")] * 2}
    out = summarize(a, cd, {"sparse": {"stock": stock, "route": route}}, {}, 2048, sfx)  # type: ignore[arg-type]
    r = out["regimes"]["sparse"]
    assert out["corpus"] == "stdlib" and out["questions"] == "span"
    assert r["question_text"] == ["\n\nQ: What follows?\nA: AB"] * 2
    assert (
        r["stock_answers"]["corpus_dependent"] == 1 and not r["stock_answers"]["agreement_counts"]
    )
    assert r["corpus_kl_nats"][0][0] > 1.0 and r["corpus_kl_nats"][0][1] == 0.0
    w = r["where_corpus_matters"]
    assert set(w) == {"route", "floor:two_servers"}
    assert (
        w["route"]["forced_steps"] == 1
    )  # a quarter of 4 positions, the one the corpus moves most
    assert w["route"]["logprob_max_abs_diff"] == pytest.approx(0.1, abs=1e-3)
    assert w["route"]["logprob_max_abs_diff"] == w["floor:two_servers"]["logprob_max_abs_diff"]
    assert r["vs_floor"]["route"]["within_floor"] == {"logprob": True, "forced_agree": True}
    assert "vs_oracle" not in r  # no --oracle run
    # with the float64 reference: stock's restart and route sit as near it as stock itself
    oracle = {"sparse": [[near, flat], [sure, flat]]}
    o = summarize(a, cd, {"sparse": {"stock": stock, "route": route}}, {}, 2048, sfx, oracle)  # type: ignore[arg-type]
    v = o["regimes"]["sparse"]["vs_oracle"]
    assert set(v) == {"stock", "stock_restart", "route", "route_over_stock"}
    assert v["route"]["logprob_max_abs_diff"] == 0.0 and v["stock_restart"]["forced_steps"] == 4
    assert v["stock"]["logprob_max_abs_diff"] == pytest.approx(0.1, abs=1e-3)
    assert v["route_over_stock"]["logprob_max_abs_diff"] == 0.0
    # a run cut short saves its JSON; `python -m tools.sglang_compare` prints its tables
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(out))
    assert compare_main([str(saved)]) == 0
    assert "route/stock over floor" in capsys.readouterr().out
    for text in ("{}", '{"regimes": {}}', "not json"):
        saved.write_text(text)
        with pytest.raises(SystemExit) as e:
            compare_main([str(saved)])
        assert e.value.code == 2


def test_report_prints_the_oracle_lines(capsys: pytest.CaptureFixture[str]) -> None:
    c = {"forced_agree_steps": 64, "forced_steps": 64, "logprob_max_abs_diff": 0.05,
         "logprob_mean_abs_diff": 0.008}  # fmt: skip
    v = {"vs_oracle": {"stock": c, "route": {**c, "logprob_max_abs_diff": 0.06},
                       "route_over_stock": {"logprob_max_abs_diff": 1.2,
                                            "logprob_mean_abs_diff": 1.0}}}  # fmt: skip
    ans = {"distinct": 1, "corpus_dependent": 1, "text": ["a"]}
    report({"regimes": {"sparse": {"vs_stock": {}, "batched_vs_sequential": {},
                                   "stock_answers": ans, **v}}})  # fmt: skip
    text = capsys.readouterr().out
    assert "sparse  vs the float64 oracle: stock 64/64, max 0.0500 mean 0.00800; route" in text
    assert "route over stock, each against the oracle: max ×1.20, mean ×1.00" in text


def test_route_trials_send_route_the_questions_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fresh route server of ``--route-trials`` is sent what the first one was: the questions
    alone. It was sent the corpus too, so it attended the corpus twice (as its own tokens and
    from the holders), and trials 2 and 3 parted from stock at 37/64 (bench_sglang on H200)."""
    import tools.bench_sglang as bs

    posted: list[dict[str, Any]] = []

    class FakeServer:
        def __init__(self, mode: str, *args: Any, **kw: Any) -> None:
            self.mode = mode

        def wait(self) -> float:
            return 0.0

        def stop(self) -> None:
            pass

        def post(self, body: dict[str, Any]) -> dict[str, Any]:
            posted.append(body)
            return {"meta_info": {"output_token_ids_logprobs": [[[-0.5, 3], [-1.0, 4]]]}}

    monkeypatch.setattr(bs, "Server", FakeServer)
    monkeypatch.setattr(bs, "server_flags", lambda a: [])
    corpus = [BOS_ID, 10, 11, 12, 13]
    suffixes = [[20, 21], [30, 31, 32]]
    answers = [[3, 4], [4, 3]]
    runs: dict[str, dict[str, Any]] = {
        "sparse": {
            "stock": {"greedy": [{"tokens": t} for t in answers]},
            "route": {"forced": [[[0.0] * 8] * 2, [[0.0] * 8] * 2]},
        }
    }
    a = argparse.Namespace(
        route_trials=2, no_cuda_graph=True, graph_bs=None, streams=(8,), work=str(tmp_path),
        port=1, kv_cache_dtype="auto",
    )  # fmt: skip
    cd = types.SimpleNamespace(tokens={"sparse": corpus})
    saves: list[int] = []
    a.route_trials = 3

    def saved() -> None:
        saves.append(len(runs["sparse"]["route"]["forced_trials"]))

    bs.route_trials(a, tmp_path / "model", cd, runs, {"sparse": suffixes}, 8, saved)  # type: ignore[arg-type]
    assert len(runs["sparse"]["route"]["forced_trials"]) == 3  # the first server's, then two
    assert saves == [2, 3], "saved after each trial: a run cut short keeps the trials it has"
    sent = sorted(tuple(b["input_ids"]) for b in posted)
    pairs = zip(suffixes, answers, strict=True)
    want = sorted(tuple(s + t[:j]) for s, t in pairs for j in range(2) for _ in range(2))
    assert sent == want, "route must be sent the questions (and forced answers) without the corpus"
    assert bs.mode_prompts("stock", corpus, suffixes) == [corpus + s for s in suffixes]


def test_stocks_one_at_a_time_pass_is_tagged_as_its_own_group() -> None:
    """``--dump``: the sequential floor's teacher-forced requests carry ``tag(j, i, group)``
    with their own group, so the selection's floor pairs them with the batched pass's rows
    (named by the regime) instead of replacing them."""
    import tools.bench_sglang as bs

    class FakeServer:
        def __init__(self) -> None:
            self.rids: list[str] = []

        def post(self, body: dict[str, Any]) -> dict[str, Any]:
            self.rids.append(str(body.get("rid", "")))
            return {"meta_info": {"output_token_ids_logprobs": [[[-0.5, 3], [-1.0, 4]]]}}

    server = FakeServer()
    prompts, ref = [[BOS_ID, 10], [BOS_ID, 11]], [[3, 4], [4, 3]]
    bs.teacher_forced(server, "stock", "sparse", prompts, ref, 8, 2, concurrent=False,  # type: ignore[arg-type]
                      tagged=True, group="sparse" + bs.SEQUENTIAL)  # fmt: skip
    bs.teacher_forced(server, "stock", "sparse", prompts, ref, 8, 2, concurrent=False,  # type: ignore[arg-type]
                      tagged=True)  # fmt: skip
    seq, batched = server.rids[:4], server.rids[4:]
    want = [bs.tag(j, i, "sparseseq") for i in range(2) for j in range(2)]
    assert [r[: len(w)] for r, w in zip(seq, want, strict=True)] == want
    assert all(r.startswith("diagsparse-s") for r in batched)


def test_report_prints_the_overlap_per_layer_beside_its_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def sel(*means: float) -> dict[str, Any]:
        layers = {str(i): {"overlap_mean": m, "overlap_min": m - 0.1} for i, m in enumerate(means)}
        return {"rows": 16, "per_layer": layers}

    ans = {"distinct": 1, "corpus_dependent": 1, "text": ["a"]}
    v = {"selection_vs_stock": {"route": sel(0.86, 0.96), "stock_sequential": sel(0.9, 0.95)}}
    report({"regimes": {"sparse": {"vs_stock": {}, "batched_vs_sequential": {},
                                   "stock_answers": ans, **v}}})  # fmt: skip
    text = capsys.readouterr().out
    assert "route/stock top-k overlap   16 rows; 0: 0.8600 (min 0.7600), 1: 0.9600" in text
    assert "stock b8/b1 top-k overlap   16 rows; 0: 0.9000 (min 0.8000)" in text


def test_report_prints_the_ties_at_the_cut(capsys: pytest.CaptureFixture[str]) -> None:
    """Per layer, the rows stock's selection cut inside an exact tie and at how many of them
    the other side took the same set; a run with none says so."""

    def sel(ties: list[int], equal: list[int]) -> dict[str, Any]:
        layers = {
            str(i): {"overlap_mean": 1.0, "overlap_min": 1.0, "ties_at_cut": t,
                     "route_equal_at_ties": e}
            for i, (t, e) in enumerate(zip(ties, equal, strict=True))
        }  # fmt: skip
        return {"rows": 16, "per_layer": layers}

    ans = {"distinct": 1, "corpus_dependent": 1, "text": ["a"]}
    v = {"selection_vs_stock": {"route": sel([0, 16, 12], [0, 3, 12]),
                                "stock_sequential": sel([0, 0, 0], [0, 0, 0])}}  # fmt: skip
    report({"regimes": {"sparse": {"vs_stock": {}, "batched_vs_sequential": {},
                                   "stock_answers": ans, **v}}})  # fmt: skip
    text = capsys.readouterr().out
    assert "route/stock at exact ties   same set in 1: 3 of 16, 2: 12 of 12" in text
    assert "stock b8/b1 at exact ties   no exact tie at the cut" in text


def test_report_prints_the_selection_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """``--dump``: beside each route mode's overlap per layer, whether it meets issue 36's bar
    (the committed 128-head run, reported again: layers 2 and 3 do not)."""
    path = Path(__file__).resolve().parents[2] / "bench/results/sglang-floor-128h-h200-dump.json"
    run = json.loads(path.read_text())
    sel = run["regimes"]["sparse"]["selection_vs_stock"]
    sel["route"]["bar"] = selection_bar(sel["route"], sel["stock_sequential"])
    report(run)
    out = capsys.readouterr().out
    assert "route/stock selection bar" in out and "not met at layers 2, 3" in out
