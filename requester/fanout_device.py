"""The fan-out engine's device half: the plan a device executor captured in CUDA graphs reads.

:mod:`requester.fanout` plans and serves a layer call from the host. Inside SGLang's graphs no
host code runs per layer, so the host half plans ahead and the device half executes that plan
at every layer (DESIGN.md, "Many engine workers, one copy"). A :class:`DevicePlan` is that
plan for one corpus: per page the holder and frame it is read from, per holder the transport
that reaches it (:data:`TRANSPORTS`, chosen per holder by whoever maps the holders), and every
page's replicas. A plan changes between steps, never inside a captured graph: when a holder
fails, :meth:`DevicePlan.failover` re-plans its pages onto live replicas and the executor
writes the new placement into its tables before the next step.

A page no live replica holds is read, after its holder's death, from that holder's pool when
its transport keeps the pool readable (:data:`RETAINED`): a pool mapped over CUDA IPC outlives
the process that exported it, and a pinned page never changes (docs/sglang.md measured it).
Only the pages of corpora planned before the death are read so (``kept``): a plan made later
excludes the dead holder outright, since a holder restarted at its address serves a new pool.

Each page is read from one of its pin replicas: the first ``pinned`` entries of its replica
list, the copies the pin placed, kept while the corpus is pinned. The first of them the device
path reaches and whose holder lives is read, so a worker on a GPU that holds the second copy
reads that one (a data-parallel rank, say). A load replica the coordinator added for a hot
holder is never read: such a copy's frames go back to its holder a grace after it leaves the
page table, and a graph reading them would read another corpus's rows with no call to fail.
With the pin count unknown (0), only the first replica counts as the pin's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from requester.corpus_view import CorpusUnavailable, CorpusView

#: Device transports, by name: CUDA IPC to a holder on the worker's own GPU (its pool mapped
#: into this process); the same mapping of a holder on another GPU of the host, read over NVLink
#: peer access (``cuda_p2p``: the worker's kernels read only the selected rows across the link);
#: NVSHMEM put/signal to a holder on another GPU of the host (route: the query goes, not rows).
TRANSPORTS = ("cuda_ipc", "cuda_p2p", "nvshmem")
#: Transports whose pool stays readable after its holder's process dies (the importer's mapping
#: holds the memory, on the holder's GPU or across the link); over NVSHMEM a dead holder answers
#: no put.
RETAINED = frozenset({"cuda_ipc", "cuda_p2p"})


def device_transport(here: str, holder_gpu: str, peer: bool = True) -> str | None:
    """The transport the device path reaches a holder on GPU ``holder_gpu`` with, from this
    process's GPU ``here`` (both UUIDs): ``cuda_ipc`` on the same GPU, ``cuda_p2p`` on another
    GPU this process sees with peer access to it (when ``peer``), else None (another host, a
    GPU outside ``CUDA_VISIBLE_DEVICES``, or no peer access: the host path serves such a
    holder). The one rule, so the executor's mapping and its reports agree."""
    from corpusd.transport import cuda_ipc

    if holder_gpu == here:
        return "cuda_ipc"
    mine = cuda_ipc.local_device(here)
    if not peer or mine is None:
        return None
    return "cuda_p2p" if cuda_ipc.peer_reachable(mine, holder_gpu) else None


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
    and how; ``dead``: holders failed over; ``kept``: those of them whose pool this plan may
    still read, for pages no live replica holds (:data:`RETAINED`)."""

    corpus_id: str
    page_size: int
    tokens: int
    replicas: tuple[tuple[tuple[str, int], ...], ...]
    transports: Mapping[str, str]
    dead: frozenset[str] = frozenset()
    kept: frozenset[str] = frozenset()
    pinned: int = 1  # each page's leading replicas that are the pin's own (see the docstring)

    def __post_init__(self) -> None:
        assert self.pinned >= 1, f"{self.pinned=}: a page has at least its first replica"
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
        """The replica page ``page`` is read from: its first pin replica on a live holder the
        device path reaches; else its first pin replica on a failed holder whose pool is
        ``kept``; else None. Load replicas (past the first ``pinned``) are never read."""
        kept = None
        for address, frame in self.replicas[page][: self.pinned]:
            if address not in self.dead and address in self.transports:
                return address, frame
            if kept is None and address in self.dead and address in self.kept:
                kept = (address, frame)
        return kept

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
        replica, or, with none, from the failed holder's own pool where its transport keeps it
        readable (:data:`RETAINED`). Raises NoDeviceTransport naming the pages left with
        neither (the caller serves those another way: the host path's route, fetch or
        local)."""
        failed = frozenset(failed)
        kept = {a for a in failed if self.transports.get(a) in RETAINED}
        return DevicePlan(
            self.corpus_id, self.page_size, self.tokens, self.replicas, self.transports,
            self.dead | failed, self.kept | kept, self.pinned,
        )  # fmt: skip

    def moved(self, before: DevicePlan) -> tuple[int, int]:
        """(pages now read from another live replica, pages now read from a failed holder's
        kept pool), against the plan ``before`` (this plan's predecessor)."""
        replica = kept = 0
        for (a0, f0), (a1, f1) in zip(before.placement, self.placement, strict=True):
            if a1 in self.dead:
                kept += 1
            elif (a0, f0) != (a1, f1):
                replica += 1
        return replica, kept


def plan_device(
    view: CorpusView, transports: Mapping[str, str], dead: Collection[str] = ()
) -> DevicePlan:
    """The device plan of the corpus ``view`` describes, over the holders in ``transports``
    (address → transport name), none of it read from the holders ``dead`` (failed since they
    were mapped: a pool they had is not read for a corpus planned after). Every replica of the
    page table is kept, the placement's first (``view.replicas``' order), whichever replica
    ``view`` itself chose; ``view.pinned`` of them are the pin's (0, unknown: the first).
    Raises NoDeviceTransport when some page has no pin replica on a live holder in
    ``transports``."""
    replicas = tuple(tuple((view.holders[h], int(f)) for h, f in page) for page in view.replicas)
    return DevicePlan(
        view.corpus_id,
        view.page_size,
        view.token_count,
        replicas,
        transports,
        frozenset(dead),
        pinned=max(1, view.pinned),
    )
