"""The fan-out engine's device half: the plan a device executor captured in CUDA graphs reads.

:mod:`requester.fanout` plans and serves a layer call from the host. Inside SGLang's graphs no
host code runs per layer, so the host half plans ahead and the device half executes that plan
at every layer (DESIGN.md, "Many engine workers, one copy"). A :class:`DevicePlan` is that
plan for one corpus: per page the holder and frame it is read from, per holder the transport
that reaches it (:data:`TRANSPORTS`, chosen per holder by whoever maps the holders), and every
page's replicas. A plan changes between steps, never inside a captured graph: when a holder
fails, :meth:`DevicePlan.failover` re-plans its pages onto live replicas and the executor
writes the new placement into its tables before the next step.

Each page is read from its first replica (the placement's frame) while that holder lives,
never from a load replica the coordinator added for a hot holder: such a copy's frames go back
to its holder a grace after it leaves the page table, and a graph reading them would read
another corpus's rows with no call to fail. Failover is the one reason to read another replica.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from requester.corpus_view import CorpusUnavailable, CorpusView

#: Device transports, by name: CUDA IPC to a holder on the worker's own GPU (its pool mapped
#: into this process); NVSHMEM put/signal to a holder on another GPU of the host.
TRANSPORTS = ("cuda_ipc", "nvshmem")


class NoDeviceTransport(CorpusUnavailable):
    """Some page of the corpus lives only on holders the device path cannot reach."""


@dataclass(frozen=True, slots=True)
class HolderGroup:
    """The pages of one corpus read from one holder: ``pages`` (corpus page numbers, ascending)
    in ``frames`` (the holder's pool frames, same order), over ``transport``."""

    address: str
    transport: str
    pages: tuple[int, ...]
    frames: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """One corpus's device plan (see the module docstring). ``replicas[p]``: every (holder
    address, frame) of page ``p``, the placement's first; ``transports``: the reachable holders
    and how; ``dead``: holders failed over."""

    corpus_id: str
    page_size: int
    tokens: int
    replicas: tuple[tuple[tuple[str, int], ...], ...]
    transports: Mapping[str, str]
    dead: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for address, t in self.transports.items():
            assert t in TRANSPORTS, f"holder {address}: transport {t!r} not in {TRANSPORTS}"
        lost = [p for p in range(len(self.replicas)) if self._source(p) is None]
        if lost:
            dead = f", holders failed: {sorted(self.dead)}" if self.dead else ""
            raise NoDeviceTransport(
                f"corpus {self.corpus_id}: pages {lost[:8]}{'…' if len(lost) > 8 else ''} are "
                f"held only on holders {sorted(self._holders(lost))} that the device path does "
                f"not reach (reachable: {sorted(self.transports)}{dead})"
            )

    def _source(self, page: int) -> tuple[str, int] | None:
        """The replica page ``page`` is read from: its first replica on a holder not failed
        over, when the device path reaches that holder (a later, reachable replica is no
        substitute while the first one lives: it may be a load replica's copy)."""
        for address, frame in self.replicas[page]:
            if address not in self.dead:
                return (address, frame) if address in self.transports else None
        return None

    def _holders(self, pages: Collection[int]) -> set[str]:
        return {a for p in pages for a, _ in self.replicas[p]}

    @property
    def n_pages(self) -> int:
        return len(self.replicas)

    @property
    def placement(self) -> tuple[tuple[str, int], ...]:
        """Per page, the (holder address, frame) it is read from."""
        return tuple(s for p in range(self.n_pages) if (s := self._source(p)) is not None)

    @property
    def groups(self) -> tuple[HolderGroup, ...]:
        """Per holder that serves some page, its pages and frames, in holder order of first
        page."""
        by: dict[str, tuple[list[int], list[int]]] = {}
        for page, (address, frame) in enumerate(self.placement):
            pages, frames = by.setdefault(address, ([], []))
            pages.append(page)
            frames.append(frame)
        return tuple(
            HolderGroup(a, self.transports[a], tuple(p), tuple(f)) for a, (p, f) in by.items()
        )

    def failover(self, failed: Collection[str]) -> DevicePlan:
        """The plan with the holders ``failed`` left out: their pages read from the next live
        replica. Raises NoDeviceTransport naming the pages left with none (the caller serves
        those another way: the host path's route, fetch or local)."""
        return DevicePlan(
            self.corpus_id, self.page_size, self.tokens, self.replicas, self.transports,
            self.dead | frozenset(failed),
        )  # fmt: skip


def plan_device(view: CorpusView, transports: Mapping[str, str]) -> DevicePlan:
    """The device plan of the corpus ``view`` describes, over the holders in ``transports``
    (address → transport name). Every replica of the page table is kept, the placement's first
    (``view.replicas``' order), whichever replica ``view`` itself chose. Raises
    NoDeviceTransport when some page has no replica on a holder in ``transports``."""
    replicas = tuple(tuple((view.holders[h], int(f)) for h, f in page) for page in view.replicas)
    return DevicePlan(view.corpus_id, view.page_size, view.token_count, replicas, transports)
