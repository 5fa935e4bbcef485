"""Fan-in admission: at most ``max_flows`` Attend/Fetch executions at once, the rest queued.

Beyond the elbow more concurrent flows only thrash (the partials share cores / SMs), so extra
requests wait in FIFO order; a request that cannot start before its deadline, or arrives to a
full queue, is refused with ``Overloaded`` (the servicer answers RESOURCE_EXHAUSTED).

The fan-in the holder reports with each heartbeat is ``mean_fanin``: flows running + queued,
time-averaged since the previous report. One instant's count says little at a small elbow: a
holder busy half the time is at 0 at half the instants, and the leader, reading 0 at every
heartbeat of a window, removed a load replica under unchanged load (bench_fanin).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator


class Overloaded(RuntimeError):
    pass


class Admission:
    def __init__(self, max_flows: int, max_queue: int, queue_timeout_s: float) -> None:
        assert max_flows > 0 and max_queue >= 0 and queue_timeout_s > 0, (
            f"{max_flows=} {max_queue=} {queue_timeout_s=}"
        )
        self.max_flows, self.max_queue, self.timeout = max_flows, max_queue, queue_timeout_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._t = self._since = time.monotonic()
        self._area = 0.0  # ∫ (active + queued) dt since ``_since``, up to ``_t``

    def _mark(self) -> None:
        """Account the fan-in up to now; call before every change of ``active`` or the queue."""
        now = time.monotonic()
        self._area += (now - self._t) * (self.active + len(self._waiters))
        self._t = now

    def mean_fanin(self) -> float:
        """Flows running + queued, time-averaged since the previous call (or creation); the
        next call averages from now. Instantaneous when no time has passed."""
        self._mark()
        elapsed = self._t - self._since
        mean = self._area / elapsed if elapsed > 0 else float(self.active + self.queued)
        self._area, self._since = 0.0, self._t
        return mean

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold one flow slot; yields the seconds spent queued."""
        t0 = time.perf_counter()
        if self.active >= self.max_flows or self._waiters:
            if len(self._waiters) >= self.max_queue:
                raise Overloaded(f"{self.active} flows running and {len(self._waiters)} queued")
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._mark()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout)
            except BaseException as e:
                granted = fut.done() and not fut.cancelled()
                if not granted:
                    self._mark()
                    self._waiters.remove(fut)
                    fut.cancel()
                    if isinstance(e, asyncio.TimeoutError):
                        raise Overloaded(f"waited {self.timeout:.3g} s for a flow slot") from None
                    raise
                if not isinstance(e, asyncio.TimeoutError):  # cancelled after the hand-over
                    self._release()
                    raise
        else:
            self._mark()
            self.active += 1
        try:
            yield time.perf_counter() - t0
        finally:
            self._release()

    def _release(self) -> None:
        self._mark()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand our slot straight to the next waiter
                return
        self.active -= 1
