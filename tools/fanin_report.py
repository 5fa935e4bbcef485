"""bench_fanin's record of one run and what is made of it: per-second rows, per-phase latency,
the coordinator's replica actions on the run's clock, and the plot (matplotlib, optional: without
it the JSON and the table are still written)."""

from __future__ import annotations

import itertools
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.summarize_results import load_full


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


@dataclass
class Run:
    t0: float
    wall0: float = field(default_factory=time.time)
    done: list[tuple[float, float]] = field(default_factory=list)  # (completed at s, latency s)
    refused: list[float] = field(default_factory=list)  # completed at s (RESOURCE_EXHAUSTED ...)
    errors: list[str] = field(default_factory=list)
    stale: list[float] = field(default_factory=list)  # NOT_FOUND from a released copy, retried
    samples: list[dict[str, Any]] = field(default_factory=list)  # fan-in / replicas, 0.5 s
    events: list[dict[str, Any]] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)  # (name, start s)
    # each Attend to one holder: (done at, perf_counter s; address; wall s; holder compute s)
    calls: list[tuple[float, str, float, float]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # address → holder id

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, what: str, **kw: Any) -> None:
        self.events.append({"t_s": round(self.now(), 2), "event": what, **kw})
        print(f"[{self.now():6.1f} s] {what} {kw if kw else ''}", flush=True)


def per_second(run: Run) -> list[dict[str, Any]]:
    end = int(max([t for t, _ in run.done] + [s["t_s"] for s in run.samples])) + 1
    rows = []
    for sec in range(end):
        lat = [x for t, x in run.done if sec <= t < sec + 1]
        smp = [s for s in run.samples if sec <= s["t_s"] < sec + 1]
        name = [n for n, t in run.phases if t <= sec + 0.5]
        fanin: dict[str, int] = {}
        for s in smp:
            for h, f in s["fanin"].items():
                fanin[h] = max(fanin.get(h, 0), f)
        rows.append(
            {
                "t_s": sec,
                "phase": name[-1] if name else "",
                "done": len(lat),
                "refused": sum(sec <= t < sec + 1 for t in run.refused),
                "p50_ms": round(pct(lat, 0.5) * 1e3, 1) if lat else None,
                "p99_ms": round(pct(lat, 0.99) * 1e3, 1) if lat else None,
                "fanin_max": fanin,
                "replicas": max((s["replicas"] for s in smp), default=None),
                "requester_replicas": max((s["requester_replicas"] for s in smp), default=None),
            }
        )
    return rows


def phase_stats(run: Run, settle_s: float) -> dict[str, Any]:
    bounds = [*run.phases, ("end", run.now())]
    out: dict[str, Any] = {}
    for (name, t0), (_, t1) in itertools.pairwise(bounds):
        lat = [x for t, x in run.done if t0 <= t < t1]
        out[name] = {
            "from_s": t0,
            "to_s": round(t1, 2),
            "done": len(lat),
            "refused": sum(t0 <= t < t1 for t in run.refused),
            "p50_ms": round(pct(lat, 0.5) * 1e3, 1),
            "p99_ms": round(pct(lat, 0.99) * 1e3, 1),
        }
    c0, c1 = next(
        ((t0, t1) for (n, t0), (_, t1) in itertools.pairwise(bounds) if n == "continued"),
        (0.0, 0.0),
    )
    late = [x for t, x in run.done if c0 + settle_s <= t < c1]
    out["continued_after_settle"] = {
        "from_s": round(c0 + settle_s, 2),
        "to_s": round(c1, 2),
        "done": len(late),
        "p50_ms": round(pct(late, 0.5) * 1e3, 1),
        "p99_ms": round(pct(late, 0.99) * 1e3, 1),
    }
    # requests that started and ended while the requester's view had the replica, under load
    spans, since = [], None
    for e in run.events:
        if e["event"].startswith("requester re-read"):
            if e["replicas"] > 1 and since is None:
                since = e["t_s"]
            elif e["replicas"] == 1 and since is not None:
                spans.append((since, e["t_s"]))
                since = None
    if since is not None:
        spans.append((since, run.now()))
    idle = next((t for n, t in run.phases if n == "idle"), run.now())
    used = [x for t, x in run.done if t < idle and any(a <= t - x and t <= b for a, b in spans)]
    out["with_replica_under_load"] = {
        "spans_s": [[round(a, 2), round(b, 2)] for a, b in spans],
        "done": len(used),
        "p50_ms": round(pct(used, 0.5) * 1e3, 1),
        "p99_ms": round(pct(used, 0.99) * 1e3, 1),
    }
    return out


def holder_stats(run: Run) -> dict[str, Any]:
    """Per phase and holder: calls, p50 of the call's wall time (queue + compute + transport)
    and of the compute the holder reports; says which copy is slower when latency splits."""
    bounds = [*run.phases, ("end", run.now())]
    out: dict[str, Any] = {}
    for (name, t0), (_, t1) in itertools.pairwise(bounds):
        per: dict[str, Any] = {}
        for addr in sorted({a for _, a, _, _ in run.calls}):
            c = [(w, x) for t, a, w, x in run.calls if a == addr and t0 <= t - run.t0 < t1]
            if c:
                per[run.names.get(addr, addr)] = {
                    "calls": len(c),
                    "wall_p50_ms": round(pct([w for w, _ in c], 0.5) * 1e3, 1),
                    "compute_p50_ms": round(pct([x for _, x in c], 0.5) * 1e3, 1),
                }
        out[name] = per
    return out


def actions(log: str, run: Run) -> list[dict[str, Any]]:
    """The coordinator's ``load replica added/removed`` lines, on the run's clock (its log
    stamps local time to the millisecond)."""
    out = []
    for ln in log.splitlines():
        m = re.match(r"(\S+ \S+),(\d+) .*load replica (added|removed)", ln)
        if m:
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            out.append({"t_s": round(at - run.wall0, 2), "action": m.group(3)})
    return out


def plot(
    rows: list[dict[str, Any]], run: Run, acts: list[dict[str, Any]], hot: str, path: Path,
    title: str,
) -> bool:  # fmt: skip
    """Latency and fan-in over time to ``path``; False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    t = [r["t_s"] + 0.5 for r in rows]
    ax.plot(t, [r["p50_ms"] for r in rows], label="p50", color="C0")
    ax.plot(t, [r["p99_ms"] for r in rows], label="p99", color="C1", alpha=0.6)
    ax.set_yscale("log")
    ax.set_ylabel("Attend latency per second (ms)")
    hs = sorted({h for s in run.samples for h in s["fanin"]})
    for i, h in enumerate(hs):
        bx.step(
            [s["t_s"] for s in run.samples],
            [s["fanin"].get(h, 0) for s in run.samples],
            where="post",
            label=f"{h}{' (hot)' if h == hot else ''}",
            color=f"C{i + 2}",
        )
    bx.set_ylabel("fan-in (flows + queued)")
    bx.set_xlabel("seconds")
    for x in (ax, bx):
        for name, t0 in run.phases:
            x.axvline(t0, color="grey", ls=":", lw=1)
            if x is ax:
                x.text(
                    t0, 1.0, f" {name}", transform=x.get_xaxis_transform(), fontsize=8, va="bottom"
                )
        for e in acts:
            x.axvline(e["t_s"], color="red" if e["action"] == "added" else "black", lw=1.2)
    ax.plot([], [], color="red", label="replica added (coordinator log)")
    ax.plot([], [], color="black", label="replica removed")
    ax.legend(fontsize=8, loc="upper left")
    bx.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def replot(result: Path, path: Path | None = None) -> Path | None:
    """The plot of a saved bench_fanin JSON (a run made with ``--plot none``, e.g. on a host
    without matplotlib), next to it unless ``path``; None without matplotlib. A summarised
    result (tools/summarize_results.py) is drawn from the samples gzip'd beside it."""
    out = load_full(result)
    run = Run(t0=0.0, samples=out["samples"])
    run.phases = [(name, s["from_s"]) for name, s in out["phases"].items() if "from_s" in s]
    png = path or result.with_suffix(".png")
    s = out["setup"]
    title = (
        f"bench_fanin: {s['holders']} holders, elbow {s['max_flows_elbow']}, "
        f"{s.get('spread', 'page')} spread; {out['machine']} (replotted from the JSON)"
    )
    acts = out["replica_actions"]
    return png if plot(out["per_second"], run, acts, out["hot_holder"], png, title) else None


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(replot(Path(name)) or "no plot: matplotlib is not installed")
