"""The plugin's bound corpora follow their page tables, as corpusd's agent worker's do (issue
21): a task on the catalog's loop re-reads each bound corpus's page table every
``CORPUSD_SGLANG_TABLE_REFRESH_S`` seconds and stages a changed view, which the catalog adopts at
the first layer of a forward (:meth:`.catalog.CorpusCatalog.at_layer`), never inside one. The
re-read, its cheap unchanged path, failover kept and a coordinator that is down are
:mod:`requester.table_refresh`'s, reused as they are.

So a load replica the coordinator adds (``corpusd/coordinator/replicas.py``) reaches the holder
calls of requests already running on the host path. The device path does not follow (NOTES.md,
item 4, says why).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from corpusd import env
from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from requester.table_refresh import Follower, TableRefresh

log = logging.getLogger("corpusd.sglang")

ENV = "CORPUSD_SGLANG_TABLE_REFRESH_S"
#: seconds between re-reads when the coordinator does not say its lease: its default lease / 3
FALLBACK_S = 10.0 / 3


def table_refresh_s(environ: Mapping[str, str] | None = None) -> float:
    """``CORPUSD_SGLANG_TABLE_REFRESH_S``: seconds between re-reads (> 0); 0 when unset or 0 (the
    coordinator's lease / 3); -1: never. Raises ValueError naming the variable for anything
    else."""
    seconds: float = env.get(ENV, environ)
    return seconds


async def lease_third(c: CoordinatorClient) -> float:
    """The coordinator's lease / 3 (what its release grace is sized for), else ``FALLBACK_S``."""
    try:
        lease = await c.lease_s()
    except CoordinatorError as e:
        log.warning("corpusd plugin: the coordinator's lease is unknown (%s); page tables are "
                    "re-read every %.1f s", e, FALLBACK_S)  # fmt: skip
        return FALLBACK_S
    return lease / 3 if lease > 0 else FALLBACK_S


async def follow(link: Follower, address: str, every_s: float, timeout: float) -> None:
    """Until cancelled: re-read the page table of every corpus bound to ``link`` every
    ``every_s`` seconds (0: the lease / 3 of the coordinator at ``address``, asked once)."""
    try:
        async with CoordinatorClient(address, timeout=timeout) as c:
            every = every_s or await lease_third(c)
            log.info("corpusd plugin: bound page tables re-read every %.2f s (%s)", every,
                     ENV if every_s else "the coordinator's lease / 3")  # fmt: skip
            await TableRefresh(link, c).run(lambda: every)
    except Exception:  # not the forward's to fail: bindings keep their views, failover stays
        log.exception("corpusd plugin: page-table re-reads stopped")
