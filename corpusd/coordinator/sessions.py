"""An agent session's home worker (its "MoE binding"), balancing batch sizes (pure function).

NanoCP binds each sequence twice: its KV to the holders WaterFill chose (the corpus) plus its
home worker (the session's own suffix), and its compute to that one worker. The two loads pull
apart — the worker with the smallest batch may hold the most suffix KV — so the choice minimises
the larger of the two fractions after adding the session ("dual balance").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A decode worker: sessions decoding there (batch) and suffix KV tokens it holds."""

    worker_id: str
    batch: int
    max_batch: int
    kv_tokens: int
    kv_capacity: int

    def __post_init__(self) -> None:
        assert self.max_batch > 0 and self.kv_capacity > 0, f"{self=}"

    def after(self, session_tokens: int) -> tuple[float, float]:
        """(batch fraction, KV fraction) once one more session of ``session_tokens`` lands."""
        return (
            (self.batch + 1) / self.max_batch,
            (self.kv_tokens + session_tokens) / self.kv_capacity,
        )

    def fits(self, session_tokens: int) -> bool:
        b, kv = self.after(session_tokens)
        return b <= 1 and kv <= 1


class NoWorker(Exception):
    """Every worker's batch or suffix KV is full."""


def choose_home(workers: Sequence[WorkerLoad], session_tokens: int = 0) -> str:
    """The worker id minimising ``max(batch fraction, KV fraction)`` after the session joins;
    ties go to the smaller batch, then the smaller id. ``session_tokens`` is the suffix it will
    grow to (its KV reservation). Raises NoWorker when no worker has room for it."""
    fit = [w for w in workers if w.fits(session_tokens)]
    if not fit:
        raise NoWorker(
            f"no worker has room for a session of {session_tokens} tokens "
            f"({len(workers)} workers, all at their batch or KV limit)"
        )
    best = min(fit, key=lambda w: (max(w.after(session_tokens)), w.batch, w.worker_id))
    return best.worker_id
