"""Failover on the device path: a holder on this GPU that dies while the server decodes through
it costs no request (issue 35, item 5).

Inside SGLang's CUDA graphs no host code runs per layer, so no holder call can fail there: the
graphs read the holders' pools in place (CUDA IPC) through the arena's tables
(:mod:`.resident`). A dead holder is found beside them instead. :class:`HolderWatch` asks every
holder mapped on this GPU for its health every ``CORPUSD_SGLANG_HOLDER_PROBE_S`` seconds, on the
catalog's event loop; one that misses :data:`MISSES` checks in a row (a SIGKILLed holder
refuses at once; a stopped one does not answer within the probe's timeout) is failed over. The
tables are rewritten on SGLang's scheduler thread before the next forward
(:func:`at_step_boundary`, from the attention backend's per-step metadata call, eager or graph
replay), on the stream that forward runs on, never while a graph that reads them replays:
each page is then read from its next live replica, or, with none, from the dead holder's pool,
which this process's CUDA IPC mapping keeps intact (:mod:`requester.fanout_device`). Either way
no step waits for the failure, and each one is counted (``corpusd_requester_fallbacks_total
{from="route"}`` per corpus, ``corpusd_requester_sglang_failed_holders_total{holder}``,
``corpusd_requester_sglang_failover_pages_total{to}``).

Corpora loaded after the failover leave the dead holder out (:meth:`.resident.Resident.plan`);
one whose pages live only there is refused at admission with the reason. The coordinator's own
re-placement reaches the arena through the binding recheck (a corpus placed anew is loaded
again for the requests that follow).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

from requester.fanout import PROBE_S
from requester.sglang.metrics import PluginMetrics
from requester.sglang.resident import FailedOver, Resident

log = logging.getLogger("corpusd.sglang")

#: health checks a mapped holder may miss in a row before it is failed over (one miss may be a
#: busy loop on a loaded machine; a dead process misses every one)
MISSES = 2

Alive = Callable[[str, float], Awaitable[bool]]


class HolderWatch:
    """Finds dead holders among ``res``'s mapped ones (:meth:`probe`, on an event loop, through
    ``alive(address, timeout)``) and fails them over between steps (:meth:`at_step_boundary`,
    on the thread that launches the forwards). ``every_s``: seconds between probes."""

    def __init__(self, res: Resident, alive: Alive, metrics: PluginMetrics, every_s: float) -> None:
        assert every_s > 0, f"{every_s=}"
        self.res, self._alive, self.metrics, self.every_s = res, alive, metrics, every_s
        self._misses: dict[str, int] = {}
        self._found: dict[str, float] = {}  # dead, not yet failed over → when found
        self._lock = threading.Lock()
        self.pending = False  # read without the lock on every step: a plain attribute
        self.failed_over: list[FailedOver] = []  # every corpus failed over, oldest first

    async def probe(self) -> set[str]:
        """One round of health checks; returns the holders found dead by it."""
        watched = [a for a in list(self.res.holder_slot)
                   if a not in self.res.dead and a not in self._found]  # fmt: skip
        answers = await asyncio.gather(*(self._alive(a, PROBE_S) for a in watched))
        dead = set()
        for address, ok in zip(watched, answers, strict=True):
            self._misses[address] = 0 if ok else self._misses.get(address, 0) + 1
            if self._misses[address] >= MISSES:
                dead.add(address)
        if dead:
            now = time.monotonic()
            with self._lock:
                self._found.update(dict.fromkeys(dead, now))
                self.pending = True
            log.warning("corpusd plugin: holders %s do not answer %d health checks in a row; "
                        "their pages fail over before the next step",
                        sorted(dead), MISSES)  # fmt: skip
        return dead

    async def run(self) -> None:
        """Probe every ``every_s`` seconds until cancelled; a probe that raises is logged and
        the next one runs."""
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.probe()
            except Exception:
                log.exception("corpusd plugin: a holder health check round failed")

    def at_step_boundary(self) -> list[FailedOver]:
        """Fail over the holders found dead since the last step (their pages to live replicas,
        or kept where none is): called before each forward, on its stream. Returns what moved
        now; costs one attribute read when nothing did."""
        if not self.pending:
            return []
        with self._lock:
            found, self._found, self.pending = dict(self._found), {}, False
        moved = self.res.fail_over(set(found))
        waited = time.monotonic() - min(found.values())
        for address in found:
            self.metrics.failed_holders.labels(address).inc()
        for m in moved:
            self.metrics.failover_pages.labels("replica").inc(m.replica)
            self.metrics.failover_pages.labels("kept").inc(m.kept)
            self.metrics.fallbacks.labels("route", "kept" if m.kept else "replica").inc()
            log.warning("corpusd plugin: corpus %s failed over from %s: %d pages to live "
                        "replicas, %d read from the dead holder's kept pool", m.corpus_id[:12],
                        sorted(found), m.replica, m.kept)  # fmt: skip
        log.warning("corpusd plugin: holders %s failed over (%d corpora) %.3f s after found dead",
                    sorted(found), len(moved), waited)  # fmt: skip
        self.failed_over += moved
        return moved


_WATCH: HolderWatch | None = None  # this scheduler process's (one model per process)
_TASK: Future[None] | None = None


def start(watch: HolderWatch, loop: asyncio.AbstractEventLoop) -> None:
    """Run ``watch`` on ``loop`` (the catalog's, in its own thread) and make it this process's
    (:func:`at_step_boundary`); a watch started before is stopped."""
    global _WATCH, _TASK
    stop()
    _WATCH, _TASK = watch, asyncio.run_coroutine_threadsafe(watch.run(), loop)
    log.info("corpusd plugin: holders on this GPU health-checked every %.2f s (failed over "
             "after %d misses)", watch.every_s, MISSES)  # fmt: skip


def stop() -> None:
    global _WATCH, _TASK
    if _TASK is not None:
        _TASK.cancel()
    _WATCH, _TASK = None, None


def at_step_boundary() -> None:
    """The attention backend's per-step hook: this process's watch's
    :meth:`HolderWatch.at_step_boundary`, when it has one. Never raises: a failure here is
    logged and the step goes on reading the tables as they were (a kept pool stays readable)."""
    w = _WATCH
    if w is None or not w.pending:
        return
    try:
        w.at_step_boundary()
    except Exception:
        log.exception("corpusd plugin: failing over dead holders failed; the next step reads "
                      "the tables as they were")  # fmt: skip
