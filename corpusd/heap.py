"""glibc's heap, seen and given back: ``corpusd_heap_bytes{state}`` on every daemon's /metrics
(:class:`HeapCollector`, from ``mallinfo2``), and a thread that calls ``malloc_trim(0)`` every
``CORPUSD_MALLOC_TRIM_S`` seconds (:func:`start_trimming`).

Why: a daemon that serves multi-MB requests (a holder's Attend tensors, an agent's Attend) frees
them into glibc's arenas, which keep the freed pages. RSS then grows while the memory in use
does not: under 8,000 fuzzed Attend calls a holder's bytes in use stayed at 187 MB while glibc
held 290 MB and RSS rose 20 % (docs/benchmarks.md, Fuzz). ``in_use`` against ``free`` tells such
retention from a leak, and trimming hands free pages back (20-50 MB a call there). Where glibc
is not the C library, both are absent and nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("corpusd")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


_LIBC = _libc()


@dataclass(frozen=True, slots=True)
class Heap:
    """Bytes of glibc's heap: ``in_use`` by the program (arena chunks and mmapped blocks),
    ``free`` (held in arenas, counted in RSS where touched), ``mmapped`` (blocks of their own)."""

    in_use: int
    free: int
    mmapped: int


def heap() -> Heap | None:
    """This process's heap now, over every arena; None without glibc's ``mallinfo2``."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return Heap(in_use=m.uordblks + m.hblkhd, free=m.fordblks, mmapped=m.hblkhd)


def trim() -> bool:
    """``malloc_trim(0)``: free pages of every arena go back to the system. False without
    glibc, or when nothing could be given back."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


class HeapCollector:
    """``corpusd_heap_bytes{state="in_use"|"free"|"mmapped"}`` at each scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        h = heap()
        if h is None:
            return
        g = GaugeMetricFamily(
            "corpusd_heap_bytes",
            "glibc heap bytes: in_use by the program, free (kept by the allocator), mmapped",
            labels=["state"],
        )
        for state in ("in_use", "free", "mmapped"):
            g.add_metric([state], getattr(h, state))
        yield g


_TRIMMING: list[threading.Thread] = []  # this process's one trimming thread, once started


def start_trimming(every_s: float) -> threading.Thread | None:
    """A daemon thread that trims the heap every ``every_s`` seconds (0: none is started; one
    a process, the first call's period)."""
    if every_s <= 0 or _LIBC is None:
        return None
    if _TRIMMING:
        return _TRIMMING[0]

    def loop() -> None:
        while True:
            time.sleep(every_s)
            trim()

    t = threading.Thread(target=loop, name="corpusd-malloc-trim", daemon=True)
    t.start()
    _TRIMMING.append(t)
    log.debug("malloc_trim every %.1f s", every_s)
    return t
