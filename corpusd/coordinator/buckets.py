"""A corpus's CP degree from its length: the profiled length-bucket table (NanoCP's DCP).

The shipped defaults live in ``cp_buckets.json`` beside this module; a calibration profile (a
JSON object with a ``"cp_buckets"`` key, as ``corpusd calibrate`` writes) replaces them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

KEY = "cp_buckets"


@dataclass(frozen=True, slots=True)
class CpBuckets:
    """``bounds``: ascending ``(max_tokens, cp_degree)``; ``max_tokens`` None = unbounded (last).
    A corpus longer than every bound takes the last bucket's degree."""

    bounds: tuple[tuple[int | None, int], ...]

    def __post_init__(self) -> None:
        if not self.bounds:
            raise ValueError(f"{KEY} is empty")
        limits = [m for m, _ in self.bounds]
        if any(m is None for m in limits[:-1]):
            raise ValueError(f"{KEY}: only the last bucket may be unbounded, got {limits}")
        finite = [m for m in limits if m is not None]
        if any(m <= 0 for m in finite) or finite != sorted(set(finite)):
            raise ValueError(f"{KEY}: max_tokens must be positive and ascending, got {limits}")
        if any(not isinstance(d, int) or d < 1 for _, d in self.bounds):
            raise ValueError(f"{KEY}: cp_degree must be an integer ≥ 1, got {self.bounds}")

    def degree(self, tokens: int) -> int:
        for limit, d in self.bounds:
            if limit is None or tokens <= limit:
                return d
        return self.bounds[-1][1]

    @classmethod
    def parse(cls, obj: Any, source: str) -> CpBuckets:
        """From a profile's JSON object; raises ValueError naming ``source`` when malformed."""
        raw = obj.get(KEY) if isinstance(obj, dict) else None
        if not isinstance(raw, list) or not all(isinstance(e, list) and len(e) == 2 for e in raw):
            raise ValueError(f"{source}: {KEY!r} must be a list of [max_tokens|null, cp_degree]")
        try:
            return cls(tuple((None if m is None else int(m), d) for m, d in raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, profile: str | Path | None = None) -> CpBuckets:
        """The table of a profile file, or the shipped defaults when ``profile`` is empty.
        Raises ValueError for an unreadable or malformed file."""
        if not profile:
            text = resources.files(__package__).joinpath("cp_buckets.json").read_text()
            return cls.parse(json.loads(text), "cp_buckets.json")
        try:
            obj = json.loads(Path(profile).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the calibration profile {profile}: {e}") from None
        return cls.parse(obj, str(profile))
