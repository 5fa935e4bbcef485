"""A dependency-free progress bar for long CPU/GPU jobs (tokens/s and ETA) on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


class Progress:
    """``update(n)`` as work completes; redraws in place on a terminal (≤ 10 Hz), otherwise
    prints a line per 10 % so logs stay short."""

    def __init__(self, label: str, total: int, unit: str = "tok", stream: TextIO | None = None):
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, n: int) -> None:
        self.done = min(self.done + n, self.total)
        now = time.perf_counter()
        if self.tty and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()
        elif not self.tty and (decile := 10 * self.done // self.total) > self._last_decile:
            self._last_decile = decile
            self.stream.write(self.line(now) + "\n")

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.perf_counter()) - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        frac = self.done / self.total
        bar = "█" * int(24 * frac) + "·" * (24 - int(24 * frac))
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        return (
            f"{self.label} |{bar}| {self.done:,}/{self.total:,} {self.unit} {100 * frac:3.0f}% "
            f"{rate:,.0f} {self.unit}/s ETA {eta}  "
        )

    def close(self) -> float:
        """Finish the line; returns the elapsed seconds."""
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()
        return time.perf_counter() - self.t0
