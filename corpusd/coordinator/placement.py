"""Where a corpus's pages go: WaterFill over the least-loaded holders (pure functions).

Units are frames (one frame holds one page). A corpus of ``P`` pages with ``r`` replicas needs
``r·P`` frames on holders such that no holder gets two copies of one page. WaterFill picks at
most ``k`` holders and the number of pages each receives so that the peak post-allocation load
of the receivers (the "water level") is as low as possible, never exceeding a holder's free
frames. The copies are then dealt by McNaughton's wrap-around rule: lay the ``r·P`` copies out
as pages ``0…P−1`` repeated ``r`` times and hand each receiver one contiguous run of at most
``P`` of them, so each holder gets one or two contiguous page ranges and never a page twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HolderLoad:
    """A live holder as placement sees it: frames in its pool and frames in use."""

    holder_id: str
    capacity: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)


@dataclass(frozen=True, slots=True)
class Placement:
    """One corpus placed. ``table[p]`` lists the holders of page ``p``'s replicas, replica 0
    first; ``shards`` maps each receiving holder to its sorted pages."""

    pages: int
    replicas: int
    degree_limit: int  # k: WaterFill could use at most this many holders
    table: tuple[tuple[str, ...], ...]
    shards: dict[str, tuple[int, ...]]
    peak: int  # the highest post-allocation load (frames) among the receivers

    @property
    def cp_degree(self) -> int:
        """Holders the corpus spans (all replicas together)."""
        return len(self.shards)


class NoFit(Exception):
    """The pin cannot be placed now. ``permanent``: not even on empty holders (too big for the
    live holders' total capacity, or fewer holders than replicas) — queueing would not help."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


def _room(h: HolderLoad, pages: int) -> int:
    return min(h.free, pages)  # a holder takes at most one copy of each page


def _contribution(h: HolderLoad, level: int, room: int) -> int:
    return min(max(level - h.used, 0), room)


def _ranked(
    holders: Sequence[HolderLoad], level: int, rooms: Sequence[int], k: int
) -> list[tuple[int, int]]:
    """The ``k`` holders taking most below ``level`` as (index, amount); ties favour the less
    loaded holder, then the smaller id, so placement is deterministic."""
    order = sorted(
        range(len(holders)),
        key=lambda i: (
            -_contribution(holders[i], level, rooms[i]),
            holders[i].used,
            holders[i].holder_id,
        ),
    )
    return [(i, _contribution(holders[i], level, rooms[i])) for i in order[:k]]


def waterfill(holders: Sequence[HolderLoad], demand: int, pages: int, k: int) -> dict[str, int]:
    """Frames per holder (holder id → amount > 0) for ``demand`` frames on at most ``k`` holders,
    each taking at most ``min(free, pages)``, minimising the receivers' peak ``used + amount``.

    The minimal level λ is the least integer at which the ``k`` largest contributions
    ``clamp(λ − used, 0, room)`` sum to ``demand``; the sum is monotone in λ, so bisection finds
    it. Raises NoFit (not permanent) when even full rooms on the best ``k`` holders fall short.
    """
    assert demand > 0 and pages > 0 and k > 0, f"{demand=} {pages=} {k=}"
    rooms = [_room(h, pages) for h in holders]
    top = max((h.used + r for h, r in zip(holders, rooms, strict=True)), default=0)
    if sum(a for _, a in _ranked(holders, top, rooms, k)) < demand:
        raise NoFit(f"{demand} frames do not fit on {k} of {len(holders)} holders", False)
    lo, hi = 0, top  # sum(lo) == 0 < demand ≤ sum(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(a for _, a in _ranked(holders, mid, rooms, k)) >= demand:
            hi = mid
        else:
            lo = mid
    chosen = _ranked(holders, hi, rooms, k)
    amounts = {i: a for i, a in chosen if a > 0}
    excess = sum(amounts.values()) - demand
    # Only receivers exactly at the level grew between λ−1 and λ, and the total at λ−1 was short
    # of demand, so fewer than their number of frames are surplus: trim one from each of them.
    at_level = [i for i, a in reversed(chosen) if a > 0 and holders[i].used + a == hi]
    assert excess < len(at_level) or excess == 0, f"{excess=} {len(at_level)=} level {hi}"
    for i in at_level[:excess]:
        amounts[i] -= 1
    return {holders[i].holder_id: a for i, a in amounts.items() if a > 0}


def deal(
    amounts: dict[str, int], pages: int, replicas: int
) -> tuple[tuple[tuple[str, ...], ...], dict[str, tuple[int, ...]]]:
    """Wrap-around assignment of the copies (see the module docstring), receivers in id order;
    returns (page → replica holders, holder → its pages)."""
    assert sum(amounts.values()) == pages * replicas, f"{amounts=} {pages=} {replicas=}"
    table: list[list[str]] = [[""] * replicas for _ in range(pages)]
    shards: dict[str, tuple[int, ...]] = {}
    start = 0
    for hid in sorted(amounts):
        n = amounts[hid]
        assert n <= pages, f"{hid} would hold a page twice: {n=} {pages=}"
        copies = range(start, start + n)
        for c in copies:
            table[c % pages][c // pages] = hid
        shards[hid] = tuple(sorted(c % pages for c in copies))
        start += n
    return tuple(tuple(r) for r in table), shards


def place(
    holders: Sequence[HolderLoad], pages: int, replicas: int = 1, cp_degree: int = 1
) -> Placement:
    """Place ``pages`` pages × ``replicas`` on ``holders`` (the live, compatible ones).

    Each replica spans up to ``cp_degree`` holders (from the length buckets), so WaterFill may
    use ``cp_degree · replicas`` of them; when that many cannot take the corpus but the holders
    together can, the limit grows until it fits — admission is by aggregate free capacity, so
    fragmentation never blocks a pin. Raises NoFit: permanent if ``replicas`` exceeds the holders
    or the corpus exceeds their total capacity, else only for lack of free frames now.
    """
    if pages <= 0 or replicas <= 0 or cp_degree <= 0:
        raise ValueError(
            f"pages, replicas, cp_degree must be > 0: {pages=} {replicas=} {cp_degree=}"
        )
    if replicas > len(holders):
        raise NoFit(f"replicas {replicas} > {len(holders)} live holders", True)
    if sum(min(h.capacity, pages) for h in holders) < pages * replicas:
        raise NoFit(
            f"{pages} pages × {replicas} replicas exceed the live holders' capacity "
            f"({sum(h.capacity for h in holders)} frames on {len(holders)} holders)",
            True,
        )
    if sum(_room(h, pages) for h in holders) < pages * replicas:
        free = sum(h.free for h in holders)
        raise NoFit(
            f"{pages} pages × {replicas} replicas do not fit in {free} free frames now", False
        )
    for k in range(min(cp_degree * replicas, len(holders)), len(holders) + 1):
        try:
            amounts = waterfill(holders, pages * replicas, pages, k)
        except NoFit:
            continue
        used = {h.holder_id: h.used for h in holders}
        table, shards = deal(amounts, pages, replicas)
        peak = max(used[h] + a for h, a in amounts.items())
        return Placement(pages, replicas, k, table, shards, peak)
    raise AssertionError(f"aggregate room suffices but no k fits: {holders=} {pages=}")


def apply(holders: Sequence[HolderLoad], p: Placement) -> list[HolderLoad]:
    """The loads after ``p`` is committed."""
    return [
        HolderLoad(h.holder_id, h.capacity, h.used + len(p.shards.get(h.holder_id, ())))
        for h in holders
    ]
