"""What ``corpusd pin`` checks against its coordinator before it tokenizes or prefills.

A prefill can take many minutes on a CPU, so everything the coordinator would refuse later is
asked first: is it reachable, are enough holders live for ``--replicas``, can any of them load
this model / page size / dtype, and (once the tokens are counted) could the pages ever fit. The
rules are the coordinator's own (``Publisher.candidates`` and ``placement.place``); a refusal is
a CoordinatorError with one line: UNAVAILABLE when unreachable, FAILED_PRECONDITION or
RESOURCE_EXHAUSTED when it would refuse the pin.
"""

from __future__ import annotations

import grpc

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError, HolderState
from corpusd.coordinator.placement import HolderLoad, NoFit, place

S = grpc.StatusCode

#: seconds to wait for the coordinator's holder list before calling it unreachable
REACH_TIMEOUT_S = 1.5


async def live_holders(
    address: str, source: str, timeout: float = REACH_TIMEOUT_S
) -> list[HolderState]:
    """The coordinator's holders. Raises CoordinatorError(UNAVAILABLE) naming the address and
    where it came from (``source``) when it does not answer within ``timeout`` seconds."""
    try:
        async with CoordinatorClient(address, timeout=timeout) as c:
            return await c.list_holders()
    except CoordinatorError as e:
        if e.code not in (S.UNAVAILABLE, S.DEADLINE_EXCEEDED):
            raise
        raise CoordinatorError(
            S.UNAVAILABLE,
            f"{address} (from {source}) is not reachable ({e.code.name}, waited at most "
            f"{timeout:g} s); nothing was pinned",
        ) from None


def fitting(
    holders: list[HolderState], replicas: int, fingerprint: str, page_size: int, dtype: str
) -> list[HolderLoad]:
    """The live holders that can load this pin, as placement sees them. Raises
    CoordinatorError(FAILED_PRECONDITION) when fewer than ``replicas`` are live, or fewer than
    ``replicas`` of them load this model fingerprint, page size and dtype."""
    live = [h for h in holders if h.info.live]
    if replicas > len(live):
        raise CoordinatorError(
            S.FAILED_PRECONDITION,
            f"replicas {replicas} > {len(live)} live holders; start more holders or lower "
            "--replicas (nothing was pinned)",
        )
    want = (fingerprint, page_size, dtype)
    fit = [h for h in live if (h.info.model_fingerprint, h.info.page_size, h.info.dtype) == want]
    if replicas > len(fit):
        seen = sorted(
            {(i.model_fingerprint[:19], i.page_size, i.dtype) for i in (h.info for h in live)}
        )
        raise CoordinatorError(
            S.FAILED_PRECONDITION,
            f"{len(fit)} of {len(live)} live holders can load this pin (model "
            f"{fingerprint[:19]}…, page size {page_size}, {dtype}); they load "
            + ", ".join(f"{m}… page {p} {d}" for m, p, d in seen)
            + f"; --replicas {replicas} (nothing was pinned)",
        )
    # The coordinator's own rule (Publisher.loads): the larger of reported and placed frames.
    return [
        HolderLoad(h.info.holder_id, h.info.capacity_frames, max(h.used_frames, h.placed_frames))
        for h in fit
    ]


def room(loads: list[HolderLoad], pages: int, replicas: int) -> str:
    """ "" when ``pages × replicas`` fit in the holders' free frames now; a note when they fit
    only once frames free (the coordinator queues such a pin). Raises
    CoordinatorError(RESOURCE_EXHAUSTED) when they exceed the holders' total capacity."""
    try:
        place(loads, pages, replicas, cp_degree=1)
    except NoFit as e:
        if e.permanent:
            raise CoordinatorError(
                S.RESOURCE_EXHAUSTED, f"{e}; it could never be placed (nothing was pinned)"
            ) from None
        return f"{e}: the coordinator will queue it until frames free"
    return ""
