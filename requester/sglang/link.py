"""The plugin's one handle on corpusd, as SGLang's model and attention backend use it.

A :class:`CorpusLink` is three parts, composed:

- :class:`.catalog.CorpusCatalog`: the corpora by name and id on one event loop (bindings,
  rechecks, the fan-out engine's per-corpus bindings, index keys, followed page tables);
- :class:`.host_path.HostPath`: the host path's per-layer executor (route / fetch per holder
  group through corpusd's fan-out engine, overlapped with SGLang's own partial);
- :class:`.device_path.DevicePath`: the device path's set-up (holders' pools mapped on this
  GPU, corpora loaded into the arena the captured graphs read).

Its methods are theirs; this module only builds them over one fan-out engine and one metrics
registry.
"""

from __future__ import annotations

import torch

from corpusd.model import ModelConfig
from requester.fanout import CorpusBinding, Fanout
from requester.predicate import Predicate, Profile
from requester.sglang.binding import Binding
from requester.sglang.catalog import RECHECK_S, CorpusCatalog
from requester.sglang.choose import Chooser
from requester.sglang.device_failover import HolderWatch
from requester.sglang.device_path import DevicePath
from requester.sglang.host_path import HostPath, Pending
from requester.sglang.metrics import PluginMetrics, Timings
from requester.sglang.resident import ArenaCorpus, Resident


class CorpusLink:
    """corpusd as SGLang's model sees it: ``bind`` a corpus name, then per layer ``index_keys``
    and ``attend`` (host path), or ``map_holders`` and ``load_resident`` (device path). ``cfg``
    is the served model's config; the corpus must have been pinned for ``fingerprint`` with
    ``page_size``-token pages. ``chooser`` picks route or fetch per (layer, holder group)
    (default: route, the defaults' profile); fetch keeps pages in a page cache of
    ``cache_bytes`` on the queries' device. ``store``: a page store this process can read, or
    None. ``table_refresh_s``: how often bound page tables are re-read (0: the coordinator's
    lease / 3; -1: never). ``holder_deadline_s``: the fan-out's deadline for a warmed-up holder
    (:meth:`requester.fanout.Fanout.deadline`; None: the call timeout only)."""

    def __init__(
        self,
        coordinator: str,
        cfg: ModelConfig,
        fingerprint: str,
        page_size: int,
        timeout: float = 60.0,
        chooser: Chooser | None = None,
        cache_bytes: int = 0,
        store: str | None = None,
        table_refresh_s: float = 0.0,
        holder_deadline_s: float | None = None,
    ) -> None:
        self.metrics = chooser.metrics if chooser is not None else PluginMetrics()
        self.chooser = chooser or Chooser(Predicate(Profile(), "route"), self.metrics)
        # The engine's own predicate re-plans only failed-over rows, by route; the chooser
        # decides every planned group. Its trace is the chooser's (the step each was made in).
        fanout = Fanout(
            Predicate(Profile(), "route"), self.metrics, transport="grpc", rpc_timeout_s=timeout,
            holder_deadline_s=holder_deadline_s, trace=self.chooser.trace,
        )  # fmt: skip
        self.catalog = CorpusCatalog(
            fanout, coordinator, cfg, fingerprint, page_size, timeout, store, table_refresh_s
        )
        self.host = HostPath(
            self.catalog, self.chooser, self.metrics, cfg.num_hidden_layers, cache_bytes
        )
        self.device = DevicePath(self.catalog)
        self.timings = Timings()

    @property
    def coordinator(self) -> str:
        return self.catalog.coordinator

    @property
    def fanout(self) -> Fanout:
        return self.catalog.fanout

    @property
    def corpora(self) -> dict[str, CorpusBinding]:
        return self.catalog.corpora

    def close(self) -> None:
        self.chooser.close()
        self.catalog.close()

    # -- the catalog -----------------------------------------------------------------------------
    def bind(self, name: str) -> Binding:
        return self.catalog.bind(name)

    def bound(self, name: str) -> Binding:
        return self.catalog.bound(name)

    def recheck(self, res: Resident | None, every_s: float = RECHECK_S, wait: bool = False
                ) -> dict[str, str]:  # fmt: skip
        return self.catalog.recheck(res, every_s, wait)

    def index_keys(self, b: Binding, layer: int, device: torch.device, ue8m0: bool) -> torch.Tensor:
        return self.catalog.index_keys(b, layer, device, ue8m0)

    def holder_formats(self) -> dict[str, str]:
        return self.catalog.holder_formats()

    # -- the host path ---------------------------------------------------------------------------
    def new_step(self, rids: list[str] | tuple[str, ...], mode: str) -> None:
        self.host.new_step(rids, mode)

    def attend(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float,
        base2: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return self.host.attend(b, layer, q, positions, scale, base2)

    def begin(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float,
        base2: bool = False,
    ) -> Pending:  # fmt: skip
        return self.host.begin(b, layer, q, positions, scale, base2)

    def finish(self, p: Pending) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host.finish(p)

    def abandon(self, p: Pending) -> None:
        self.host.abandon(p)

    # -- the device path -------------------------------------------------------------------------
    def map_holders(self, res: Resident, device: torch.device, peer: bool = True) -> list[str]:
        return self.device.map_holders(res, device, peer)

    def watch_holders(self, res: Resident, every_s: float) -> HolderWatch:
        return self.device.watch_holders(res, every_s, self.metrics)

    def load_resident(self, b: Binding, res: Resident, admitted: bool = False) -> ArenaCorpus:
        return self.device.load_resident(b, res, admitted)
