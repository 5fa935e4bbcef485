"""Calibration drift: is the cost model still right? Over each window of decisions, the median
of measured / predicted cost per primitive; a median outside ``[1/band, band]`` (default
``[1/2, 2]``) is logged once per window and counted, so a stale or foreign profile shows.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

log = logging.getLogger("corpusd.requester")


class Drift:
    """Windows of ``window`` measured/predicted ratios per primitive. ``observe`` returns the
    window's median when a window closes with its median outside the band, else None; each such
    window logs one warning (naming ``profile``, what the predictions came from) and calls
    ``on_drift(primitive, median)``; every closed window calls ``on_window(primitive, median)``.
    """

    def __init__(
        self,
        window: int = 256,
        band: float = 2.0,
        profile: str = "",
        on_window: Callable[[str, float], None] | None = None,
        on_drift: Callable[[str, float], None] | None = None,
    ) -> None:
        assert window > 0 and band > 1, f"{window=}, {band=}"
        self.window, self.band, self.profile = window, band, profile
        self.on_window, self.on_drift = on_window, on_drift
        self.ratios: dict[str, list[float]] = {}

    def observe(self, primitive: str, measured_s: float, predicted_s: float) -> float | None:
        """One decision's cost; non-positive or non-finite ones are not a ratio and are skipped."""
        if not (predicted_s > 0 and measured_s >= 0) or predicted_s == float("inf"):
            return None
        ratios = self.ratios.setdefault(primitive, [])
        ratios.append(measured_s / predicted_s)
        if len(ratios) < self.window:
            return None
        median = statistics.median(ratios)
        ratios.clear()
        if self.on_window is not None:
            self.on_window(primitive, median)
        if 1 / self.band <= median <= self.band:
            return None
        log.warning(
            "%s: measured/predicted cost median %.2f over the last %d decisions, outside "
            "[%.2g, %.2g]: the calibration profile (%s) does not fit this machine now; "
            "run `corpusd calibrate` (or restart `corpusd up`, which calibrates when stale)",
            primitive,
            median,
            self.window,
            1 / self.band,
            self.band,
            self.profile or "defaults",
        )
        if self.on_drift is not None:
            self.on_drift(primitive, median)
        return median
