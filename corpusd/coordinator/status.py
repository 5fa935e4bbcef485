"""``corpusd status``: the coordinator's holders and corpora as two plain-text tables."""

from __future__ import annotations

from collections.abc import Sequence

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
