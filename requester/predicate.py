"""The route / fetch / local cost model (DESIGN.md, "Cost model and predicate") and its profile.

    route = α + n·(B_q + B_o)/β + t_partial(n, k) + t_merge
    fetch = [α + bytes(missing pages)/β] + t_splice + t_local(n, k) + t_merge
    local = t_prefill(missing tokens) + t_splice + t_local(n, k) + t_merge

DESIGN's fetch and local omit the requester's own partial over the pulled rows (``t_local``);
it is real work on the requester, so it is counted here. Pages already fetched and rows already
re-prefilled cost nothing more, so the same group may route on its first step and fetch later.
Every term is a constant measured by ``corpusd calibrate``; evaluating it is arithmetic.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

PRIMITIVES = ("route", "fetch", "local")


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured constants (µs, bytes). Partial time is linear in ``n·k·h`` (the score and value
    products dominate), its base the fixed per-call cost."""

    transport: str = "grpc-loopback"
    alpha_us: float = 600.0  # probe round trip of an almost empty request
    beta_bytes_per_us: float = 2000.0  # effective bandwidth of large messages
    holder_partial_base_us: float = 150.0
    holder_partial_us_per_nkh: float = 2.5e-3
    local_partial_base_us: float = 50.0
    local_partial_us_per_nkh: float = 2.5e-3
    merge_us_per_nh: float = 0.01
    splice_us_per_row: float = 0.05  # gather + k_pe rotation of one fetched row
    prefill_us_per_token: float = 4000.0
    source: str = "defaults (not calibrated)"
    # what it was measured for and when (``corpusd up`` recalibrates when these do not match)
    model_fingerprint: str = ""
    device: str = ""
    created_at: float = 0.0  # unix seconds; 0: never calibrated
    mode: str = ""  # "full" or "quick"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not v >= 0:
                raise ValueError(f"profile {f.name} must be >= 0, got {v}")
        if self.beta_bytes_per_us <= 0:
            raise ValueError("profile beta_bytes_per_us must be > 0")

    def save(self, path: Path) -> None:
        """Write atomically (a worker watching the file never reads half of it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    def stale(self, fingerprint: str, device: str, max_age_s: float, now: float) -> str:
        """Why this profile does not fit (a model or device other than the one given, older
        than ``max_age_s``, never calibrated); "" when it fits."""
        if not self.created_at:
            return "it holds no calibration (defaults)"
        if self.model_fingerprint != fingerprint:
            return f"it was measured for model {self.model_fingerprint[:19] or '(unknown)'}…"
        if self.device != device:
            return f"it was measured on {self.device or '(unknown device)'}, this is {device}"
        age = now - self.created_at
        if age > max_age_s:
            return f"it is {age / 86400:.1f} days old (more than {max_age_s / 86400:g})"
        return ""

    @classmethod
    def load(cls, path: Path) -> Profile:
        """Raises ValueError naming the file when it is not a profile."""
        try:
            d = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in d.items() if k in known})
        except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a corpusd calibration profile: {e}") from None


@dataclass(frozen=True, slots=True)
class Group:
    """One holder group of one layer step: ``n`` query rows of ``h`` heads selecting ``k``
    (max per row) rows on that holder; ``rows`` selections in all; what fetch / local would
    still have to bring in."""

    n: int
    k: int
    h: int
    rows: int
    missing_pages: int
    page_bytes: int
    missing_tokens: int
    local_ok: bool
    kv_dim: int = 576
    d_v: int = 512
    fetch_ok: bool = True  # the pages fit where fetched pages are kept


@dataclass(frozen=True, slots=True)
class Decision:
    """``pick`` and every primitive's predicted µs (inf: cannot serve the group). ``fallback``:
    the forced primitive that could not serve the group, when ``pick`` stands in for it."""

    pick: str
    predicted_us: dict[str, float]
    fallback: str | None = None


class Predicate:
    def __init__(self, profile: Profile, force: str = "auto") -> None:
        if force not in ("auto", *PRIMITIVES):
            raise ValueError(f"primitive must be auto or one of {PRIMITIVES}, got {force!r}")
        self.profile, self.force = profile, force

    def costs(self, g: Group) -> dict[str, float]:
        p = self.profile
        if g.k == 0:
            return {name: 0.0 for name in PRIMITIVES}
        nkh, nh = g.n * g.k * g.h, g.n * g.h
        b_q = g.h * g.kv_dim * 4 + g.k * 4
        b_o = g.h * (g.d_v + 1) * 4
        merge = p.merge_us_per_nh * nh
        local_attend = (
            p.local_partial_base_us
            + p.local_partial_us_per_nkh * nkh
            + p.splice_us_per_row * g.rows
        )
        route = (
            p.alpha_us
            + g.n * (b_q + b_o) / p.beta_bytes_per_us
            + p.holder_partial_base_us
            + p.holder_partial_us_per_nkh * nkh
            + merge
        )
        pull = p.alpha_us + g.missing_pages * g.page_bytes / p.beta_bytes_per_us
        fetch = (pull if g.missing_pages else 0.0) + local_attend + merge
        local = p.prefill_us_per_token * g.missing_tokens + local_attend + merge
        out = {"route": route, "fetch": fetch, "local": local}
        if not g.local_ok:
            out["local"] = math.inf
        if not g.fetch_ok:
            out["fetch"] = math.inf
        return out

    def decide(self, g: Group) -> Decision:
        """The cheapest primitive, or the forced one; a forced primitive that cannot serve the
        group (``local`` without tokens, ``fetch`` whose pages do not fit) gives way to the
        cheapest that can, named in ``fallback``."""
        costs = self.costs(g)
        cheapest = min(PRIMITIVES, key=lambda k: costs[k])
        if self.force == "auto":
            return Decision(cheapest, costs)
        if math.isinf(costs[self.force]) and math.isfinite(costs[cheapest]):
            return Decision(cheapest, costs, fallback=self.force)
        return Decision(self.force, costs)
