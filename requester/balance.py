"""Each holder's measured speed, for spreading replicated pages (:meth:`CorpusView.reweighted`).

An Attend over replicated pages is a fork-join: every holder serves a share of the rows and the
call waits for the slowest. Page ``p`` on replica ``p mod n`` gives equal holders equal shares,
but copies are not equal: a load replica lands on another machine, another GPU, cores shared
with something else (on the 16-core bench host a replica holder computed the same half of the
rows 1.4× slower than the hot holder, and the calls waited for it). So the requester times its
own calls, seconds per row and holder (queue, transport and compute: what its rows will wait),
and gives each holder pages in proportion to its speed, re-weighting at most every ``every_s``
and only when a weight moved by more than ``change``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class HolderSpeed:
    """Exponentially weighted seconds per row, by holder address."""

    def __init__(
        self,
        alpha: float = 0.1,
        min_calls: int = 8,
        every_s: float = 1.0,
        change: float = 0.1,
        step: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (0 < alpha <= 1 and 0 < step <= 1 and min_calls >= 1 and every_s >= 0 <= change):
            raise ValueError(
                f"alpha {alpha} and step {step} must be in (0, 1], min_calls {min_calls} >= 1, "
                f"every_s {every_s} and change {change} >= 0"
            )
        self.alpha, self.min_calls, self.every_s, self.change = alpha, min_calls, every_s, change
        self.step = step
        self.clock = clock
        self.per_row: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._last = float("-inf")

    def observe(self, address: str, rows: int, seconds: float) -> None:
        """One call to ``address`` that served ``rows`` rows in ``seconds`` (wall)."""
        if rows <= 0 or not seconds >= 0:
            return
        x = seconds / rows
        old = self.per_row.get(address)
        self.per_row[address] = x if old is None else old + self.alpha * (x - old)
        self.calls[address] = self.calls.get(address, 0) + 1

    def weights(self, holders: tuple[str, ...]) -> tuple[float, ...] | None:
        """Rows per second of each of ``holders``, normalised to a mean of 1; a holder not yet
        measured ``min_calls`` times gets the median of the others. None while fewer than two
        are measured (nothing to compare)."""
        known = {
            a: 1.0 / self.per_row[a]
            for a in holders
            if self.calls.get(a, 0) >= self.min_calls and self.per_row[a] > 0
        }
        if len(known) < 2:
            return None
        fill = statistics.median(known.values())
        w = [known.get(a, fill) for a in holders]
        mean = sum(w) / len(w)
        return tuple(x / mean for x in w)

    def due(
        self, holders: tuple[str, ...], current: tuple[float, ...] | None
    ) -> tuple[float, ...] | None:
        """New weights for ``holders`` when it is time (``every_s`` since the last) and one moved
        by more than ``change`` from ``current``; else None (keep the view as it is). From
        ``current`` they move ``step`` of the way: a holder given more pages also queues more,
        so the full move would overshoot and swing back."""
        now = self.clock()
        if now - self._last < self.every_s:
            return None
        self._last = now
        w = self.weights(holders)
        if w is None:
            return None
        if current is None or len(current) != len(w):
            return w
        w = tuple(c + self.step * (x - c) for x, c in zip(w, current, strict=True))
        moved = any(
            abs(a - b) > self.change * max(b, 1e-9) for a, b in zip(w, current, strict=True)
        )
        return w if moved else None
