"""``corpusd status`` and ``corpusd ls``: the coordinator's holders, corpora and agent workers as
plain-text tables, or as JSON for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from corpusd.coordinator.client import CorpusStatus, HolderState, WorkerState


def render(
    holders: list[HolderState], corpora: list[CorpusStatus], workers: Sequence[WorkerState] = ()
) -> str:
    """Holders (lease, capacity, use, fan-in), corpora (state, pages, CP degree, replicas),
    then agent workers (sessions, batch, KV)."""
    lines = [f"holders ({sum(h.info.live for h in holders)} live of {len(holders)})"]
    lines.append(
        f"  {'id':<16} {'address':<22} {'lease':<8} {'frames':>8} {'used':>8} {'placed':>8} "
        f"{'fan-in':>6}  device"
    )
    for h in holders:
        i = h.info
        lease = "live" if i.live else f"expired ({h.heartbeat_age_s:.0f} s)"
        lines.append(
            f"  {i.holder_id:<16} {i.address:<22} {lease:<8} {i.capacity_frames:>8} "
            f"{h.used_frames:>8} {h.placed_frames:>8} {h.active_flows:>6}  {i.device}"
        )
    lines.append(f"corpora ({len(corpora)})")
    lines.append(
        f"  {'id':<14} {'name':<18} {'state':<10} {'tokens':>9} {'pages':>6} {'cp':>3} "
        f"{'rep':>3}  holders"
    )
    for c in corpora:
        state = f"queued#{c.queue_position}" if c.state == "queued" else c.state
        held = ", ".join(h + (" (expired)" if h in c.expired_holders else "") for h in c.holder_ids)
        lines.append(
            f"  {c.corpus_id[:12] + '…':<14} {c.name[:18]:<18} {state:<10} {c.tokens:>9,} "
            f"{c.pages:>6} {c.cp_degree:>3} {c.replicas:>3}  {held or '-'}"
        )
    lines.append(f"agent workers ({sum(w.live for w in workers)} live of {len(workers)})")
    lines.append(
        f"  {'id':<16} {'address':<22} {'report':<8} {'sessions':>8} {'batch':>9} "
        f"{'kv rows':>16}  corpora"
    )
    for w in workers:
        r = w.report
        seen = "live" if w.live else f"{w.age_s:.0f} s ago"
        lines.append(
            f"  {r.worker_id:<16} {r.address:<22} {seen:<8} {r.sessions:>8} "
            f"{f'{r.generating}/{r.max_batch}':>9} {f'{r.kv_tokens:,}/{r.kv_capacity:,}':>16}  "
            f"{', '.join(c[:12] for c in r.corpora) or '-'}"
        )
    return "\n".join(lines)


def age(seconds: float) -> str:
    """``seconds`` the way ``ls`` shows an age: "42 s", "7 min", "5 h", "3 d"."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(max(seconds, 0))} s"


def render_corpora(corpora: Sequence[CorpusStatus]) -> str:
    """``corpusd ls``: one line per corpus (name, id, tokens, replicas, holders, state, age)."""
    rows = [("NAME", "ID", "TOKENS", "REPLICAS", "HOLDERS", "STATE", "AGE")]
    for c in corpora:
        state = f"queued#{c.queue_position}" if c.state == "queued" else c.state
        held = ",".join(h + ("(expired)" if h in c.expired_holders else "") for h in c.holder_ids)
        rep = str(c.replicas) if c.replicas else "-"
        rows.append(
            (c.name, c.corpus_id[:12], f"{c.tokens:,}", rep, held or "-", state, age(c.state_age_s))
        )
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: tuple[str, ...]) -> str:
        cells = [
            v.rjust(w) if i in (2, 3) else v.ljust(w)
            for i, (v, w) in enumerate(zip(r, width, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join(line(r) for r in rows)


def as_json(value: Any) -> str:
    """Dataclasses (lists of them, dicts of those) as indented JSON; tuples become lists."""

    def plain(v: Any) -> Any:
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return asdict(v) if hasattr(v, "__dataclass_fields__") else v

    return json.dumps(plain(value), indent=1)
