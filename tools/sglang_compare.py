"""What ``tools/bench_sglang.py`` computes from its runs, apart from running them: agreement of
two runs' tokens and log-probabilities, and the plugin predicate's score against forced runs.

CPU-importable (no sglang, no server): the bench's numbers can be checked on synthetic runs.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: ``--primitive``: each is the route mode with CORPUSD_SGLANG_PRIMITIVE forced to it
PRIMITIVES = ("route", "fetch", "auto")
#: the route mode under a forced primitive: ``route@fetch``
SEP = "@"
#: route variants, compared with stock and its floors in the same run as ``route``: the route
#: mode with a plugin setting changed (``route+one``: own tokens and corpus rows attended in one
#: FlashMLA call, ``CORPUSD_SGLANG_ONE_CALL``, stock's own arithmetic on the device path)
VARIANT = "+"
VARIANTS: dict[str, dict[str, str]] = {"one": {"CORPUSD_SGLANG_ONE_CALL": "1"}}


def primitive_modes(modes: list[str], primitives: list[str]) -> list[str]:
    """``modes`` with ``route`` replaced by ``route@<p>`` for each of ``primitives`` (in that
    order; none given: unchanged). Raises ValueError for an unknown primitive or a list without
    route."""
    if not primitives:
        return modes
    bad = [p for p in primitives if p not in PRIMITIVES]
    if bad or len(set(primitives)) != len(primitives):
        raise ValueError(f"--primitive {','.join(primitives)}: distinct ones of {PRIMITIVES}")
    if "route" not in modes:
        raise ValueError("--primitive forces the route mode's primitive: --modes needs route")
    at = modes.index("route")
    return modes[:at] + [f"route{SEP}{p}" for p in primitives] + modes[at + 1 :]


def is_route(mode: str) -> bool:
    return mode == "route" or mode.startswith((f"route{SEP}", f"route{VARIANT}"))


def variant_env(mode: str) -> dict[str, str]:
    """The plugin settings a ``route+<variant>`` mode adds to the route server's environment
    (none for any other mode)."""
    if not mode.startswith(f"route{VARIANT}"):
        return {}
    return VARIANTS[mode.split(VARIANT, 1)[1]]


def check_modes(modes: list[str]) -> None:
    """ValueError naming the first of ``modes`` that is not stock, route, fetch, ``route@<p>``
    or ``route+<variant>``, or a mode given twice."""
    known = {"stock", "route", "fetch", *(f"route{SEP}{p}" for p in PRIMITIVES)}
    known |= {f"route{VARIANT}{v}" for v in VARIANTS}
    for m in modes:
        if m not in known:
            raise ValueError(f"--modes: unknown mode {m!r}; known: {', '.join(sorted(known))}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes {','.join(modes)}: a mode given twice")


def mode_tag(mode: str) -> str:
    """``mode`` as it appears in request ids and directory names (no ``@`` or ``+``)."""
    return mode.replace(SEP, "-").replace(VARIANT, "-")


def forced_primitive(mode: str) -> str | None:
    return mode.split(SEP, 1)[1] if SEP in mode else None


def vectors(meta: dict[str, Any], vocab: int) -> list[list[float]]:
    """Per output position, the log-softmax over the whole vocabulary."""
    out = []
    for step in meta["output_token_ids_logprobs"]:
        v = [math.nan] * vocab
        for lp, tok, *_ in step:
            v[int(tok)] = float(lp)
        out.append(v)
    return out


def argmax(v: list[float]) -> int:
    return max(range(len(v)), key=v.__getitem__)


def free_running(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens equal position by position, and each request's first differing step."""
    same = total = 0
    first_div = []
    for ta, tb in zip(ref, got, strict=True):
        same += sum(x == y for x, y in zip(ta, tb, strict=True))
        total += len(ta)
        first_div.append(
            next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        )
    return {"greedy_agree": same / total, "first_divergence": first_div}


#: a first divergence at a stock top-2 margin under this is a near-tie (issue 18)
NEAR_TIE_NATS = 0.05


def divergences(
    first: list[int],
    lengths: list[int],
    ref_forced: list[list[list[float]]],
    got_forced: list[list[list[float]]],
) -> dict[str, Any]:
    """Each free-running answer that differs: its first differing step and both sides' top-2
    margin there (nats). Up to that step both ran the same context, so the teacher-forced
    vectors at it are the distributions each side chose from; a step past the forced steps
    has no margin (None). ``all_near_ties``: every divergence has a margin, and stock's is under
    :data:`NEAR_TIE_NATS`."""

    def margin(v: list[float]) -> float:
        top = sorted(v, reverse=True)
        return round(top[0] - top[1], 5)

    rows: list[dict[str, Any]] = []
    for i, (d, n) in enumerate(zip(first, lengths, strict=True)):
        if d >= n:
            continue  # the same answer
        known = d < len(ref_forced[i]) and d < len(got_forced[i])
        rows.append({
            "request": i,
            "step": d,
            "stock_top2_margin": margin(ref_forced[i][d]) if known else None,
            "got_top2_margin": margin(got_forced[i][d]) if known else None,
        })  # fmt: skip
    near = all(r["stock_top2_margin"] is not None and r["stock_top2_margin"] < NEAR_TIE_NATS
               for r in rows)  # fmt: skip
    return {"near_tie_nats": NEAR_TIE_NATS, "all_near_ties": near, "rows": rows}


def forced_compare(ref: list[list[list[float]]], got: list[list[list[float]]]) -> dict[str, Any]:
    """Two teacher-forced runs on the same contexts (``[request][step][vocab]`` log-softmax):
    argmax agreement, and |Δ log-prob| over entries above −30 in both, at every step and at the
    first; ``ref``'s top-2 margin wherever the argmax differs."""
    agree = steps = 0
    diffs: list[float] = []
    first: list[float] = []
    margins = []
    for ra, rb in zip(ref, got, strict=True):
        for j, (va, vb) in enumerate(zip(ra, rb, strict=True)):
            steps += 1
            if argmax(va) == argmax(vb):
                agree += 1
            else:
                top = sorted(va, reverse=True)
                margins.append(top[0] - top[1])
            d = [abs(x - y) for x, y in zip(va, vb, strict=True) if x > -30 and y > -30]
            diffs += d
            if j == 0:
                first += d
    return {
        "forced_agree": agree / steps,
        "forced_agree_steps": agree,
        "forced_steps": steps,
        "ref_top2_margin_where_forced_differs": margins,
        "logprob_max_abs_diff": max(diffs),
        "logprob_mean_abs_diff": statistics.fmean(diffs),
        "first_step_logprob_max_abs_diff": max(first),
        "first_step_logprob_mean_abs_diff": statistics.fmean(first),
    }


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Free-running greedy agreement position by position; teacher-forced argmax agreement and
    log-softmax differences (:func:`forced_compare`)."""
    free = free_running([g["tokens"] for g in ref["greedy"]], [g["tokens"] for g in got["greedy"]])
    return {
        **free,
        "divergences": divergences(
            free["first_divergence"],
            [len(g["tokens"]) for g in ref["greedy"]],
            ref["forced"],
            got["forced"],
        ),
        **forced_compare(ref["forced"], got["forced"]),
    }


# -- stock against stock: the floor route's figures are read against (issue 36) -----------------
#: the issue's bars: route's max and mean |Δ log-prob| within this factor of the floor's ...
FLOOR_FACTOR = 1.5
#: ... and its teacher-forced argmax agreement no lower than the floor's minus one step in this
FLOOR_AGREE_SLACK = 64


def _ratio(a: float, b: float) -> float | None:
    """a / b; 1.0 when both are 0, None (no finite ratio) when only b is."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else None


def noise_floor(stock: dict[str, Any]) -> dict[str, Any]:
    """Stock against itself on the same teacher-forced contexts: ``batched_vs_sequential`` (the
    same server, the bench's concurrent forced requests against the same ones one at a time) and
    ``two_servers`` (against a freshly started second stock server), each
    :func:`forced_compare`; a floor whose run is missing is left out."""
    out = {}
    if stock.get("forced_sequential"):
        out["batched_vs_sequential"] = forced_compare(stock["forced"], stock["forced_sequential"])
    if stock.get("forced_restart"):
        out["two_servers"] = forced_compare(stock["forced"], stock["forced_restart"])
    return out


# -- where the corpus matters (issue 36): stock with the corpus against stock without it ---------
#: the share of teacher-forced positions, those the corpus moves most, reported apart
CORPUS_TOP = 0.25


def kl(la: list[float], lb: list[float]) -> float:
    """KL(a ‖ b) in nats between two log-softmax vectors (NaN: a token the server did not
    return, left out; b's missing or -inf entries read as -100: a corpus that makes a token
    certain which was impossible without it scores high, not infinite)."""
    out = 0.0
    for x, y in zip(la, lb, strict=True):
        if math.isnan(x) or x == -math.inf:
            continue
        out += math.exp(x) * (x - (y if y == y and y > -100 else -100.0))
    return max(out, 0.0)


def corpus_kl(
    with_corpus: list[list[list[float]]], bare: list[list[list[float]]]
) -> list[list[float]]:
    """``[request][step]``: how far the corpus moves stock's next-token distribution, KL(stock
    with the corpus ‖ stock given the question alone), on the same teacher-forced answers."""
    return [
        [kl(a, b) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(with_corpus, bare, strict=True)
    ]


def where_corpus_matters(
    ref: list[list[list[float]]], got: list[list[list[float]]], kls: list[list[float]],
    top: float = CORPUS_TOP,
) -> dict[str, Any]:  # fmt: skip
    """:func:`forced_compare` restricted to the ``top`` share of positions with the largest
    corpus KL (:func:`corpus_kl`): where an answer depends on attention over the corpus, the
    positions an agreement figure must hold at."""
    ranked = sorted(
        ((k, i, j) for i, row in enumerate(kls) for j, k in enumerate(row)), reverse=True
    )
    chosen = ranked[: max(1, round(top * len(ranked)))]
    f = forced_compare([[ref[i][j] for _, i, j in chosen]], [[got[i][j] for _, i, j in chosen]])
    keys = ("forced_agree", "forced_agree_steps", "forced_steps", "logprob_max_abs_diff",
            "logprob_mean_abs_diff")  # fmt: skip
    return {
        "top_share": top,
        "corpus_kl_min_nats": chosen[-1][0],
        "corpus_kl_mean_nats": statistics.fmean(k for k, _, _ in chosen),
        **{k: f[k] for k in keys},
    }


def against_floor(got: dict[str, Any], floors: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A mode's teacher-forced figures against stock (``got``: :func:`compare`'s) beside each
    floor and as ratios to it, and the issue's bars against the noisiest floor (the larger max
    and mean |Δ log-prob|, the lower agreement of the floors): max and mean within
    :data:`FLOOR_FACTOR` × the floor's, agreement ≥ the floor's minus ``steps /``
    :data:`FLOOR_AGREE_SLACK` (at least one step)."""
    keys = ("forced_agree", "logprob_max_abs_diff", "logprob_mean_abs_diff",
            "first_step_logprob_max_abs_diff")  # fmt: skip
    per = {}
    for name, f in floors.items():
        per[name] = {
            **{f"floor_{k}": f[k] for k in keys},
            "max_over_floor": _ratio(got["logprob_max_abs_diff"], f["logprob_max_abs_diff"]),
            "mean_over_floor": _ratio(got["logprob_mean_abs_diff"], f["logprob_mean_abs_diff"]),
            "agree_steps_minus_floor": got["forced_agree_steps"] - f["forced_agree_steps"],
        }
    out: dict[str, Any] = {"mode": {k: got[k] for k in keys}, "floors": per}
    if not floors:
        return out
    fmax = max(f["logprob_max_abs_diff"] for f in floors.values())
    fmean = max(f["logprob_mean_abs_diff"] for f in floors.values())
    fagree = min(f["forced_agree_steps"] for f in floors.values())
    slack = max(1, got["forced_steps"] // FLOOR_AGREE_SLACK)
    out["noisiest_floor"] = {
        "logprob_max_abs_diff": fmax, "logprob_mean_abs_diff": fmean,
        "forced_agree_steps": fagree,
        "max_over_floor": _ratio(got["logprob_max_abs_diff"], fmax),
        "mean_over_floor": _ratio(got["logprob_mean_abs_diff"], fmean),
    }  # fmt: skip
    r_max, r_mean = (out["noisiest_floor"][k] for k in ("max_over_floor", "mean_over_floor"))
    out["within_floor"] = {
        "logprob": r_max is not None and r_mean is not None
        and r_max <= FLOOR_FACTOR and r_mean <= FLOOR_FACTOR,
        "forced_agree": got["forced_agree_steps"] >= fagree - slack,
    }  # fmt: skip
    return out


def over_trials(
    ref: list[list[list[float]]], trials: list[list[list[list[float]]]],
    floors: dict[str, dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """Route's teacher-forced figures over several freshly started servers (``trials``, each
    ``[request][step][vocab]`` on ``ref``'s contexts): per trial :func:`forced_compare` against
    ``ref`` and its ratios to the noisiest floor (:func:`against_floor`), then the median, min
    and max of each figure over the trials, the bars read on the medians."""
    per = []
    for t in trials:
        c = forced_compare(ref, t)
        c.pop("ref_top2_margin_where_forced_differs")
        nf = against_floor(c, floors).get("noisiest_floor", {})
        per.append(c | {k: nf[k] for k in ("max_over_floor", "mean_over_floor") if k in nf})
    keys = ["forced_agree_steps", "logprob_max_abs_diff", "logprob_mean_abs_diff"]
    if floors:
        keys += ["max_over_floor", "mean_over_floor"]
    stats: dict[str, Any] = {}
    for name in keys:
        xs = [p[name] for p in per if p.get(name) is not None]
        if xs:
            stats[name] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    steps = sum(len(r) for r in ref)
    out: dict[str, Any] = {"trials": len(trials), "forced_steps": steps, "stats": stats}
    if floors and "max_over_floor" in stats and "mean_over_floor" in stats:
        fagree = min(f["forced_agree_steps"] for f in floors.values())
        out["within_floor_on_medians"] = {
            "logprob": stats["max_over_floor"]["median"] <= FLOOR_FACTOR
            and stats["mean_over_floor"]["median"] <= FLOOR_FACTOR,
            "forced_agree": stats["forced_agree_steps"]["median"]
            >= fagree - max(1, steps // FLOOR_AGREE_SLACK),
        }  # fmt: skip
    out["per_trial"] = per
    return out


# -- the plugin's predicate against forced runs ------------------------------------------------
def load_trace(path: Path) -> list[dict[str, Any]]:
    """The plugin's decisions (``CORPUSD_SGLANG_TRACE``, JSON lines); [] when none was written."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last may be cut short (read while written)
                raise
    return out


def group_costs(trace: Iterable[dict[str, Any]], tag: str) -> dict[tuple, dict[str, Any]]:
    """Decisions of requests whose rid contains ``tag`` (the bench's sequential greedy phase:
    one request per forward), keyed by (rid from ``tag`` on without its unique suffix, the
    request's n-th forward, layer, holder) so the same group of another run has the same key."""
    steps: dict[str, list[int]] = {}
    picked = []
    for t in trace:
        rids = t.get("rids", [])
        if len(rids) != 1 or tag not in rids[0]:
            continue
        req = rids[0][rids[0].index(tag) :].rsplit("-", 1)[0]
        if t["step"] not in steps.setdefault(req, []):
            steps[req].append(t["step"])
        picked.append((req, t))
    return {(req, steps[req].index(t["step"]), t["layer"], t["holder"]): t for req, t in picked}


def predicate_score(
    traces: dict[str, list[dict[str, Any]]], tag: str, slack: float = 0.10
) -> dict[str, Any]:
    """Auto against forced route and fetch on the same requests (``traces``: primitive → that
    run's trace), as ``tools/bench_decode.py`` scores corpusd's worker: each auto decision is
    right when it picked the primitive whose forced run measured cheaper for the same group;
    and auto's total measured cost over the groups all three runs have is within ``slack`` of
    the better forced run's total."""
    by = {p: group_costs(traces.get(p, []), tag) for p in PRIMITIVES}
    keys = sorted(set(by["route"]) & set(by["fetch"]) & set(by["auto"]), key=str)
    right, picks, wrong = 0, {"route": 0, "fetch": 0}, list[dict[str, Any]]()
    totals = {p: 0.0 for p in PRIMITIVES}
    for k in keys:
        costs = {p: by[p][k]["measured_us"] for p in ("route", "fetch")}
        pick = by["auto"][k]["pick"]
        picks[pick] = picks.get(pick, 0) + 1
        best = min(costs, key=lambda p: costs[p])
        right += pick == best
        if pick != best and len(wrong) < 20:
            wrong.append({"group": list(k), "pick": pick, "measured_us": costs,
                          "predicted_us": by["auto"][k]["predicted_us"]})  # fmt: skip
        for p in PRIMITIVES:
            totals[p] += by[p][k]["measured_us"]
    better = min(totals["route"], totals["fetch"])
    ratio = totals["auto"] / better if better > 0 else None
    return {
        "groups": len(keys),
        "unmatched": {p: len(by[p]) - len(keys) for p in PRIMITIVES},
        "right": right,
        "share_right": right / len(keys) if keys else None,
        "auto_picks": picks,
        "measured_us_total": totals,
        "auto_over_better_forced": ratio,
        "auto_within_slack": ratio is not None and ratio <= 1 + slack,
        "wrong_examples": wrong,
    }


def exactness(route: dict[str, Any], fetch: dict[str, Any], bound: float = 0.02) -> dict[str, Any]:
    """Route vs fetch, both teacher-forced on the same reference tokens: argmax agreement (all
    steps must agree) and mean |Δ log-prob| (≤ ``bound``)."""
    c = compare(route, fetch)
    agree = round(c["forced_agree"] * c["forced_steps"])
    return {
        "forced_agree_steps": agree,
        "forced_steps": c["forced_steps"],
        "logprob_mean_abs_diff": c["logprob_mean_abs_diff"],
        "logprob_max_abs_diff": c["logprob_max_abs_diff"],
        "ok": agree == c["forced_steps"] and c["logprob_mean_abs_diff"] <= bound,
    }


def report(out: dict[str, Any]) -> None:
    """Print the bench's summary (``out``, as ``tools/bench_sglang.py`` saves it) as tables."""
    print(f"{'regime':<7} {'vs':<11} {'greedy':>6} {'forced':>6} {'lp max':>7} {'lp mean':>8}")
    for r, v in out["regimes"].items():
        pairs = {f"{m}/stock": c for m, c in v["vs_stock"].items()}
        if "route_vs_fetch" in v:
            pairs["route/fetch"] = v["route_vs_fetch"]
        for name, c in pairs.items():
            print(
                f"{r:<7} {name:<11} {c['greedy_agree']:>6.3f} {c['forced_agree']:>6.3f} "
                f"{c['logprob_max_abs_diff']:>7.4f} {c['logprob_mean_abs_diff']:>8.5f}"
            )
        for m, c in v["batched_vs_sequential"].items():
            print(f"{r:<7} {m + ' b8/b1':<11} {c['greedy_agree']:>6.3f}")
        for name, c in pairs.items():
            dv = c.get("divergences")
            if dv and dv["rows"]:
                at = [(x["step"], x["stock_top2_margin"]) for x in dv["rows"]]
                print(f"{r:<7} {name:<11} first divergences (step, stock top-2 margin): {at}; "
                      f"all under {dv['near_tie_nats']} nats: {dv['all_near_ties']}")  # fmt: skip
    for r, v in out["regimes"].items():
        for name, f in v.get("noise_floor", {}).items():
            print(f"{r:<7} {'stock ' + name:<27} forced {f['forced_agree_steps']}/"
                  f"{f['forced_steps']}, |Δ log-prob| max {f['logprob_max_abs_diff']:.4f} "
                  f"mean {f['logprob_mean_abs_diff']:.5f}")  # fmt: skip
        for m, c in v.get("vs_floor", {}).items():
            if "noisiest_floor" not in c:
                continue
            nf, ok = c["noisiest_floor"], c["within_floor"]
            print(f"{r:<7} {m + '/stock over floor':<27} max ×{nf['max_over_floor']}, mean "
                  f"×{nf['mean_over_floor']} (bar {FLOOR_FACTOR}: "
                  f"{'ok' if ok['logprob'] else 'FAILS'}), forced agreement "
                  f"{'ok' if ok['forced_agree'] else 'BELOW'} the floor's")  # fmt: skip
        if "route_trials" in v and "max_over_floor" in v["route_trials"]["stats"]:
            t = v["route_trials"]
            s = {k: t["stats"][k] for k in ("max_over_floor", "mean_over_floor",
                                            "forced_agree_steps")}  # fmt: skip
            who = f"route, {t['trials']} servers"
            print(f"{r:<7} {who:<27} "
                  f"over floor, median [min–max]: max ×{s['max_over_floor']['median']:.2f} "
                  f"[{s['max_over_floor']['min']:.2f}–{s['max_over_floor']['max']:.2f}], mean "
                  f"×{s['mean_over_floor']['median']:.2f} [{s['mean_over_floor']['min']:.2f}–"
                  f"{s['mean_over_floor']['max']:.2f}], forced "
                  f"{s['forced_agree_steps']['median']}/{t['forced_steps']}")  # fmt: skip
    for r, v in out["regimes"].items():  # --dump: top-k overlap per layer, beside its floor
        for m, sel in v.get("selection_vs_stock", {}).items():
            who = "stock b8/b1" if m == "stock_sequential" else f"{m}/stock"
            layers = sorted(sel.get("per_layer", {}).items(), key=lambda t: int(t[0]))
            cells = ", ".join(
                f"{li}: {x['overlap_mean']:.4f} (min {x['overlap_min']:.4f})" for li, x in layers
            )
            print(f"{r:<7} {who + ' top-k overlap':<27} {sel.get('rows', 0)} rows; {cells}")
            tied = [(li, x) for li, x in layers if x.get("ties_at_cut")]
            if layers and "ties_at_cut" in layers[0][1]:  # stock's rows cut inside a tie
                ties = ", ".join(
                    f"{li}: {x['route_equal_at_ties']} of {x['ties_at_cut']}" for li, x in tied
                )
                said = "same set in " + ties if tied else "no exact tie at the cut"
                print(f"{r:<7} {who + ' at exact ties':<27} {said}")
            if "bar" in sel:
                bar = sel["bar"]
                short = [li for li, x in bar["per_layer"].items() if not x["met"]]
                print(f"{r:<7} {who + ' selection bar':<27} "
                      f"{'met' if bar['met'] else 'not met at layers ' + ', '.join(short)} "
                      f"(>= 0.99 or >= stock vs itself, per layer)")  # fmt: skip
    for r, v in out["regimes"].items():
        if "vs_oracle" in v:  # every run against corpusd's model in float64 (sglang_oracle.py)
            o = v["vs_oracle"]
            runs = "; ".join(
                f"{k} {c['forced_agree_steps']}/{c['forced_steps']}, max "
                f"{c['logprob_max_abs_diff']:.4f} mean {c['logprob_mean_abs_diff']:.5f}"
                for k, c in o.items() if k != "route_over_stock"
            )  # fmt: skip
            print(f"{r:<7} vs the float64 oracle: {runs}")
            if "route_over_stock" in o:
                q = o["route_over_stock"]
                print(f"{r:<7} route over stock, each against the oracle: max "
                      f"×{q['logprob_max_abs_diff']:.2f}, "
                      f"mean ×{q['logprob_mean_abs_diff']:.2f}")  # fmt: skip
    for r, v in out["regimes"].items():
        if "primitive_exactness" in v:
            e = v["primitive_exactness"]
            print(f"{r}: route vs fetch (plugin) teacher-forced {e['forced_agree_steps']}/"
                  f"{e['forced_steps']}, mean |Δ log-prob| {e['logprob_mean_abs_diff']:.4f} "
                  f"({'ok' if e['ok'] else 'FAILS'} the 64/64, ≤ 0.02 bar)")  # fmt: skip
        if "predicate" in v:
            s = v["predicate"]
            ratio = s["auto_over_better_forced"]
            print(f"{r}: predicate right {s['right']}/{s['groups']} groups, picks "
                  f"{s['auto_picks']}, auto / better forced {ratio and round(ratio, 3)} "
                  f"({'within' if s['auto_within_slack'] else 'OUTSIDE'} 10 %)")  # fmt: skip
            if "inter_token_p50_ms" in s:
                print(f"{r}: inter-token p50 ms by primitive {s['inter_token_p50_ms']}, auto / "
                      f"better forced {s['auto_itl_over_better_forced']:.3f}")  # fmt: skip
    for r, v in out["regimes"].items():
        ans = v["stock_answers"]
        print(f"{r}: stock answers {ans['distinct']} distinct, {ans['corpus_dependent']} change "
              f"without the corpus: {ans['text'][:2]}")  # fmt: skip
        if "agreement_counts" in ans and not ans["agreement_counts"]:
            print(f"{r}: fewer than 3 in 4 answers depend on the corpus: its agreement figures "
                  "say little about attention over the corpus")  # fmt: skip
        for m, w in v.get("where_corpus_matters", {}).items():
            print(f"{r} {m + '/stock where the corpus matters':<40} agree {w['forced_agree_steps']}"
                  f"/{w['forced_steps']}, |Δ log-prob| max {w['logprob_max_abs_diff']:.3f} mean "
                  f"{w['logprob_mean_abs_diff']:.4f} (corpus KL >= "
                  f"{w['corpus_kl_min_nats']:.2f} nats)")  # fmt: skip
    for r, v in out["regimes"].items():
        for m, ft in v.get("first_token", {}).items():
            if "cold_p50_ms" in ft:
                print(f"{r}: {m} first token p50, idle server: cold {ft['cold_p50_ms']:.1f} ms "
                      f"(after /flush_cache), warm {ft['warm_p50_ms']:.1f} ms")  # fmt: skip
        if "first_token_score" in v:
            print(f"{r}: first token targets {v['first_token_score']}")
    print(
        f"{'regime':<7} {'mode':<6} {'streams':>7} {'ttft ms':>8} {'itl p50 ms':>10} "
        f"{'itl adj ms':>10} {'tpot p50 ms':>11} {'kv':>6}"
    )
    for r, v in out["regimes"].items():
        for m, by in v.get("concurrent_by_streams", {}).items():
            for n, first in by.items():
                for i, c in enumerate([first, *first.get("repeats", [])]):
                    label = n if i == 0 else f"{n}#{i + 1}"  # a repeated burst: warm
                    print(
                        f"{r:<7} {m:<6} {label:>7} {c['ttft_p50_ms']:>8.1f} "
                        f"{c['inter_token_p50_ms']:>10.2f} "
                        f"{c.get('inter_token_burst_adjusted_p50_ms', float('nan')):>10.2f} "
                        f"{c.get('tpot_p50_ms', float('nan')):>11.2f} "
                        f"{c['kv_pool_peak_tokens']:>6.0f}"
                    )


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.sglang_compare RESULT.json``: print a saved bench result's tables (a
    run cut short by its time limit saves after every route mode, before it prints them)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("result", type=Path, help="a tools/bench_sglang.py JSON")
    a = ap.parse_args(argv)
    try:
        out = json.loads(a.result.read_text())
        regimes = out["regimes"]
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{a.result}: not a bench_sglang result ({type(e).__name__}: {e})")
    if not regimes:
        ap.error(f"{a.result}: no regime has a stock run yet")
    report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
