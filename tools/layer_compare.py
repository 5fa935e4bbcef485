"""Stock against route, layer by layer, from the per-layer dumps of both servers
(``requester/sglang/dump.py``): what ``tools/diag_layer_diff.py`` reports and what
``tools/bench_sglang.py --dump`` puts in its JSON (selection overlap, ties at the cut).

CPU-importable (no sglang): the arithmetic is tested on synthetic dumps.

Per layer of one teacher-forced row, in the order the layer computes them:

- ``scores``: the index scores of the keys both could select (logical order), max |Δ| and
  max |Δ| relative to stock's largest;
- ``selection``: overlap ``|S ∩ R| / |S|`` of stock's set ``S`` and route's ``R``; where they
  differ, the **margin at the cut** on each side: stock's ``k``-th best score minus the best
  stock score among the keys only route took (0 = an exact tie, the tie rule decided), and the
  same from route's scores; whether stock's row had an exact tie at its cut;
- ``attn``: the attention output's relative L2 difference and max |Δ|;
- ``hidden``: the layer's output hidden state, the same.

:func:`first_parting` names the first (layer, component) past its tolerance.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from typing import Any

import torch

from requester.sglang.topk import ties_at_cut

#: How a teacher-forced request is named in both servers: request ``q``, forced step ``s`` (with
#: a group, e.g. the bench's regime: ``diag<group>-s<s>-q<q>-``).
TAG = re.compile(r"diag-s(\d+)-q(\d+)-")
COMPONENTS = ("scores", "selection", "attn", "hidden")
#: default tolerances: relative L2 for attn / hidden (bf16 runs differ by ~1e-2 from summation
#: order alone), relative max |Δ| for the scores; any selection difference counts
TOL = {"scores": 1e-2, "attn": 3e-2, "hidden": 3e-2}


def tag(step: int, request: int, group: str = "") -> str:
    """The rid fragment both servers' teacher-forced requests carry (:data:`TAG`)."""
    return f"diag{group}-s{step}-q{request}-"


def _pos(record: dict[str, Any]) -> float:
    p = record.get("position")
    return float("inf") if p is None else float(p)


def pair(
    stock: Iterable[dict[str, Any]], route: Iterable[dict[str, Any]], group: str = "",
    route_group: str | None = None,
) -> list[tuple[tuple[int, int], dict[str, Any], dict[str, Any]]]:  # fmt: skip
    """Records of the same teacher-forced row on both sides, by (step, request) from the rid
    (:func:`tag` with ``group``, on the second side ``route_group`` when given: two runs of one
    server, e.g. its batched and its one-at-a-time pass); keys on one side only are left out.

    A key's row is its record at the **lowest** position, the last row of the request's one
    extend: SGLang's overlap scheduler launches the next batch before it reads the last one's
    results, so a request that is done after its first token can still ride one more decode
    forward, recorded one position later (issue 36: 40 of 64 rows of a GPU run paired an
    extend with that decode). At equal positions the last record wins (a retried request)."""

    def pattern(g: str) -> re.Pattern[str]:
        return TAG if not g else re.compile(rf"diag{re.escape(g)}-s(\d+)-q(\d+)-")

    def keyed(
        recs: Iterable[dict[str, Any]], p: re.Pattern[str]
    ) -> dict[tuple[int, int], dict[str, Any]]:
        out: dict[tuple[int, int], dict[str, Any]] = {}
        for r in recs:
            m = p.search(str(r["rid"]))
            if not m:
                continue
            key = (int(m.group(1)), int(m.group(2)))
            if key not in out or _pos(r) <= _pos(out[key]):
                out[key] = r
        return out

    a = keyed(stock, pattern(group))
    b = keyed(route, pattern(group if route_group is None else route_group))
    return [(k, a[k], b[k]) for k in sorted(set(a) & set(b))]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.float().norm())
    num = float((a.float() - b.float()).norm())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def _cut_margin(scores: torch.Tensor, mine: torch.Tensor, others: torch.Tensor) -> float | None:
    """The ``k``-th best of ``scores`` over this side's selection ``mine`` minus the best of
    ``scores`` over ``others`` (keys only the other side took): ≥ 0 when this side's order is
    right, 0 at an exact tie; None without scores or without a difference."""
    if others.numel() == 0 or mine.numel() == 0:
        return None
    n = scores.shape[0]
    mine, others = mine[mine < n], others[others < n]
    if others.numel() == 0 or mine.numel() == 0:
        return None
    return float(scores[mine].min() - scores[others].max())


def compare_layer(s: dict[str, torch.Tensor], r: dict[str, torch.Tensor], k: int) -> dict[str, Any]:
    """One layer of one row on both sides (missing pieces are left out of the result)."""
    out: dict[str, Any] = {}
    ss, rs = s.get("scores"), r.get("scores")
    if ss is not None and rs is not None:
        n = min(ss.shape[0], rs.shape[0])
        d = (ss[:n] - rs[:n]).abs()
        top = float(ss[:n].abs().max()) if n else 0.0
        out["scores"] = {
            "keys": n,
            "max_abs_diff": float(d.max()) if n else 0.0,
            "max_rel_diff": (float(d.max()) / top if top > 0 else 0.0) if n else 0.0,
            "lengths": [int(ss.shape[0]), int(rs.shape[0])],
        }
    if "sel" in s and "sel" in r:
        a, b = s["sel"].long(), r["sel"].long()
        only_s = a[~torch.isin(a, b)]
        only_r = b[~torch.isin(b, a)]
        sel: dict[str, Any] = {
            "k": int(a.numel()),
            "overlap": (a.numel() - only_s.numel()) / a.numel() if a.numel() else 1.0,
            "only_stock": only_s.tolist()[:16],
            "only_route": only_r.tolist()[:16],
            "n_only_stock": int(only_s.numel()),
            "n_only_route": int(only_r.numel()),
        }
        if ss is not None:
            lengths = torch.tensor([ss.shape[0]])
            sel["stock_tie_at_cut"] = bool(ties_at_cut(ss[None], lengths, k)[0])
            sel["stock_margin_at_cut"] = _cut_margin(ss, a, only_r)
        if rs is not None:
            sel["route_margin_at_cut"] = _cut_margin(rs, b, only_s)
        out["selection"] = sel
    for kind in ("attn", "hidden"):
        if kind in s and kind in r:
            out[kind] = {
                "rel_l2": _rel(r[kind], s[kind]),
                "max_abs_diff": float((r[kind].float() - s[kind].float()).abs().max()),
            }
    return out


def parted(component: str, c: dict[str, Any], tol: dict[str, float]) -> bool:
    """Whether a layer's ``component`` (:func:`compare_layer`'s entry) is past its tolerance."""
    if component == "selection":
        return c["overlap"] < 1.0
    if component == "scores":
        return c["max_rel_diff"] > tol["scores"]
    return c["rel_l2"] > tol[component]


def first_parting(layers: dict[int, dict[str, Any]], tol: dict[str, float] | None = None) -> Any:
    """The first ``{"layer", "component"}`` (layers ascending, components in
    :data:`COMPONENTS` order) past its tolerance, or None when the row agrees everywhere."""
    t = {**TOL, **(tol or {})}
    for li in sorted(layers):
        for comp in COMPONENTS:
            c = layers[li].get(comp)
            if c is not None and parted(comp, c, t):
                return {"layer": li, "component": comp}
    return None


def compare_records(
    s: dict[str, Any], r: dict[str, Any], k: int, tol: dict[str, float] | None = None
) -> dict[str, Any]:
    """Every layer of one row (:func:`compare_layer`) and its :func:`first_parting`."""
    layers = {
        int(li): compare_layer(s["layers"][li], r["layers"][li], k)
        for li in s["layers"]
        if li in r["layers"]
    }
    return {
        "positions": [s.get("position"), r.get("position")],
        "layers": layers,
        "first_parting": first_parting(layers, tol),
    }


def selection_agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layer over the compared rows (:func:`compare_records`' results): top-k overlap
    (mean, min, rows below 1), stock rows with an exact tie at the cut, and at those the rows
    where route selected stock's set; plus the overlap per (step, request) row."""
    per: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        for li, c in row["layers"].items():
            if "selection" in c:
                per.setdefault(int(li), []).append(c["selection"])
    out: dict[str, Any] = {}
    for li, sels in sorted(per.items()):
        ov = [x["overlap"] for x in sels]
        ties = [x for x in sels if x.get("stock_tie_at_cut")]
        out[str(li)] = {
            "rows": len(sels),
            "overlap_mean": statistics.fmean(ov),
            "overlap_min": min(ov),
            "rows_below_1": sum(o < 1.0 for o in ov),
            "ties_at_cut": len(ties),
            "route_equal_at_ties": sum(x["overlap"] == 1.0 for x in ties),
        }
    return out


def report_lines(result: dict[str, Any]) -> list[str]:
    """A human summary of :func:`compare_records` rows keyed ``"s<step>q<request>"``."""
    lines = []
    for key, row in result.items():
        fp = row["first_parting"]
        where = (
            "agree everywhere" if fp is None else f"part at layer {fp['layer']}, {fp['component']}"
        )
        lines.append(f"{key}: {where}")
        for li, c in sorted(row["layers"].items()):
            sel = c.get("selection", {})
            cells = [f"  layer {li}:"]
            if "scores" in c:
                cells.append(f"scores Δmax {c['scores']['max_abs_diff']:.3g}")
            if sel:
                cells.append(f"overlap {sel['overlap']:.4f}")
                if sel["overlap"] < 1:
                    ms, mr = sel.get("stock_margin_at_cut"), sel.get("route_margin_at_cut")
                    tie = sel.get("stock_tie_at_cut")
                    cells.append(f"margin stock {ms} route {mr} tie {tie}")
            for kind in ("attn", "hidden"):
                if kind in c:
                    cells.append(f"{kind} rel {c[kind]['rel_l2']:.3g}")
            lines.append(" ".join(cells))
    return lines


def overlap_by_layer_and_step(rows: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any]:
    """``{layer: {step: mean top-k overlap over the requests}}`` from :func:`compare_records`
    results keyed (step, request)."""
    acc: dict[int, dict[int, list[float]]] = {}
    for (step, _q), row in rows.items():
        for li, c in row["layers"].items():
            if "selection" in c:
                acc.setdefault(int(li), {}).setdefault(step, []).append(c["selection"]["overlap"])
    return {
        str(li): {str(s): statistics.fmean(v) for s, v in sorted(by.items())}
        for li, by in sorted(acc.items())
    }


def selection_vs_stock(
    stock: list[dict[str, Any]], route: list[dict[str, Any]], k: int, group: str = "",
    route_group: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What the bench reports of a mode's selection against stock's on the teacher-forced rows
    of ``group`` recorded at the same logical position on both sides (the others counted in
    ``position_mismatch``): per layer (:func:`selection_agreement`: overlap, ties at the cut,
    route equal at the ties) and per layer and step (:func:`overlap_by_layer_and_step`)."""
    pairs = pair(stock, route, group, route_group)
    # A pair recorded at two different logical positions is not one row computed twice (a
    # dump's row mapping gone wrong, issue 36): left out of the figures, and listed.
    apart = [(key, a.get("position"), b.get("position")) for key, a, b in pairs
             if a.get("position") != b.get("position")]  # fmt: skip
    rows = {
        key: compare_records(a, b, k)
        for key, a, b in pairs
        if a.get("position") == b.get("position")
    }
    return {
        "rows": len(rows),
        "position_mismatch": len(apart),
        "mismatched": [{"key": f"s{s}q{q}", "positions": [pa, pb]} for (s, q), pa, pb in apart[:8]],
        "per_layer": selection_agreement(list(rows.values())),
        "per_layer_step": overlap_by_layer_and_step(rows),
    }


#: Issue 36's bar for the top-k selection: overlap with stock at least this per layer, or no
#: lower than stock's own against itself.
OVERLAP_BAR = 0.99


def selection_bar(mode: dict[str, Any], floor: dict[str, Any] | None) -> dict[str, Any]:
    """Per layer, a mode's mean top-k overlap with stock (a :func:`selection_vs_stock` result)
    beside stock's own against itself (``floor``, the same function on stock's batched and
    one-at-a-time passes; None: not measured) and whether it meets issue 36's bar: ≥
    :data:`OVERLAP_BAR`, or no lower than the floor's. ``met``: every layer's (None when no
    layer was compared)."""
    per = {}
    for li, x in mode.get("per_layer", {}).items():
        f = (floor or {}).get("per_layer", {}).get(li)
        fo = None if f is None else f["overlap_mean"]
        ok = x["overlap_mean"] >= OVERLAP_BAR or (fo is not None and x["overlap_mean"] >= fo)
        per[li] = {"overlap": x["overlap_mean"], "floor": fo, "met": ok}
    return {"per_layer": per, "met": all(v["met"] for v in per.values()) if per else None}
