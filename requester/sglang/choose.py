"""The predicate inside SGLang: per (layer, holder group) of a host-path call, route or fetch.

The cost model is corpusd's own (:class:`requester.predicate.Predicate`, the profile ``corpusd
calibrate`` writes), with two plugin facts: the local partial is this process's sparse kernel
(FlashMLA on the GPU), whose two terms are measured here at start (:func:`local_terms`), and a
fetched page is attended in place (no splice). ``missing_pages`` comes from the plugin's page
cache, so a group that fetched on one step is cheap to fetch on the next.

``local`` (DESIGN: re-prefill the chunk) is stock SGLang's own prefill of the corpus, which is
chosen per request (send the corpus in the prompt, unbound) before SGLang schedules it, not per
layer inside a forward: the plugin never picks it, and ``CORPUSD_SGLANG_PRIMITIVE=local`` is
refused with that reason.

The arithmetic and the fallback of a forced primitive that cannot serve a group are the
engine's (:meth:`requester.predicate.Predicate.decide`); each decision is recorded by the engine
(:meth:`requester.fanout.Fanout.record`: metrics, the drift windows of :mod:`requester.drift`),
into a JSON-lines trace when ``CORPUSD_SGLANG_TRACE`` names a file (:class:`StepTrace`: each
entry with the forward step it was made in).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch

from corpusd import env as corpusd_env
from requester.fanout import counted
from requester.plan import GroupWork, group_shape
from requester.predicate import Decision, Predicate, Profile
from requester.sglang.metrics import PluginMetrics

log = logging.getLogger("corpusd.sglang")
ENV_PRIMITIVE = "CORPUSD_SGLANG_PRIMITIVE"
ENV_PROFILE = "CORPUSD_SGLANG_PROFILE"
ENV_TRACE = "CORPUSD_SGLANG_TRACE"
PRIMITIVES = corpusd_env.SGLANG_PRIMITIVES


def primitive(environ: Mapping[str, str] | None = None) -> str:
    """``CORPUSD_SGLANG_PRIMITIVE`` (default auto). Raises ValueError saying what is allowed
    (``local`` with the reason it is not a per-layer choice)."""
    value: str = corpusd_env.get(ENV_PRIMITIVE, environ)
    return value


def profile(environ: Mapping[str, str] | None = None) -> Profile:
    """The calibration profile: ``CORPUSD_SGLANG_PROFILE``, else ``$CORPUSD_HOME/profile.json``
    when present, else the defaults (logged). Raises ValueError naming a file that is not one."""
    return load_profile(corpusd_env.get(ENV_PROFILE, environ))


def load_profile(path: Path | None) -> Profile:
    """The profile at ``path`` (a file), or with None ``$CORPUSD_HOME/profile.json`` when
    present, else the defaults (logged). Raises ValueError for a file that is not a profile."""
    if path is not None:
        return Profile.load(path)
    default = corpusd_env.home() / "profile.json"
    if default.is_file():
        return Profile.load(default)
    log.warning(
        "corpusd plugin: no calibration profile (%s unset, no %s): the route/fetch predicate "
        "uses default constants; run `corpusd calibrate`", ENV_PROFILE, default,
    )  # fmt: skip
    return Profile()


def local_terms(
    device: torch.device, heads: int, kv_dim: int, d_v: int, base2: bool, repeats: int = 3
) -> tuple[float, float]:
    """``(base µs, µs per n·k·h)`` of :func:`.device.sparse_partial` on ``device``: a line fitted
    to its median time over a small grid of rows × k (synchronised on CUDA)."""
    from requester.calibrate import fit_line
    from requester.sglang.device import sparse_partial

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(4096, kv_dim, generator=g).to(device, torch.bfloat16)
    xs, ys = [], []
    for n in (1, 8):
        for k in (128, 512):
            q = torch.randn(n, heads, kv_dim, generator=g).to(device, torch.bfloat16)
            rows = torch.randint(0, 4096, (n, k), generator=g).to(device, torch.int32)
            times = []
            for _ in range(repeats + 1):  # the first warms
                t0 = time.perf_counter()
                sparse_partial(q, kv, rows, kv_dim**-0.5, d_v, base2)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            xs.append(float(n * k * heads))
            ys.append(sorted(times[1:])[len(times[1:]) // 2] * 1e6)
    return fit_line(xs, ys)


class Chooser:
    """The plugin's predicate: decides route or fetch per group from the plugin's facts, and
    knows the forward step its decisions belong to. ``force``: auto | route | fetch; ``trace``:
    a JSON-lines file its decisions are appended to (:attr:`trace`)."""

    def __init__(
        self,
        predicate: Predicate,
        metrics: PluginMetrics,
        trace: str | None = None,
    ) -> None:
        assert predicate.force in PRIMITIVES, predicate.force
        self.predicate, self.metrics = predicate, metrics
        self.trace = StepTrace(trace, self) if trace else None
        self.step, self.mode = 0, ""
        self.rids: tuple[str, ...] = ()
        self._local_measured = False

    @property
    def force(self) -> str:
        return self.predicate.force

    def new_step(self, rids: tuple[str, ...], mode: str) -> None:
        self.step, self.rids, self.mode = self.step + 1, rids, mode

    def measure_local(self, device: torch.device, heads: int, kv_dim: int, d_v: int,
                      base2: bool) -> None:  # fmt: skip
        """Once, before the first decision that may fetch: this process's sparse kernel's terms
        (a forced fetch's predictions use them too, so its measured/predicted ratio means the
        same as auto's)."""
        if self._local_measured or self.force == "route":
            return
        self._local_measured = True
        base, slope = local_terms(device, heads, kv_dim, d_v, base2)
        p = replace(
            self.predicate.profile, local_partial_base_us=base, local_partial_us_per_nkh=slope,
            splice_us_per_row=0.0,  # fetched rows are attended in place
            source=f"{self.predicate.profile.source} + plugin's sparse partial on {device}",
        )  # fmt: skip
        self.predicate = Predicate(p, self.force)
        log.info("corpusd plugin: local sparse partial %.1f µs + %.3g µs per n·k·h", base, slope)

    def decide(
        self, g: GroupWork, heads: int, kv_dim: int, d_v: int, missing_pages: int,
        page_bytes: int, fits: bool,
    ) -> Decision:  # fmt: skip
        """Route or fetch for group ``g`` (the plugin never re-prefills: local is out); fetch
        is out when its pages do not fit the page cache (``fits``), and a forced fetch that
        cannot fit routes (counted as a fallback)."""
        shape = group_shape(
            g, heads, kv_dim, d_v, missing_pages=missing_pages, page_bytes=page_bytes,
            fetch_ok=fits,
        )  # fmt: skip
        return counted(self.predicate.decide(shape), self.metrics)

    @property
    def forced(self) -> bool:
        """Whether a pick is forced rather than the cost model's (for the decision metrics)."""
        return self.force != "auto"

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


class StepTrace:
    """A JSON-lines file of the engine's decisions (:meth:`requester.fanout.Fanout.record`'s
    trace), each entry with the plugin's step, mode, requests and forced primitive."""

    def __init__(self, path: str, chooser: Chooser) -> None:
        self.chooser = chooser
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115

    def append(self, entry: dict[str, Any], /) -> None:
        c = self.chooser
        entry |= {"step": c.step, "mode": c.mode, "rids": list(c.rids), "force": c.force}
        self._file.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._file.close()
