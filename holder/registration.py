"""A holder started with ``--coordinator``: register, then heartbeat within the lease.

The holder serves whether or not the coordinator answers: registration is retried with backoff,
and a heartbeat answered NOT_FOUND (a coordinator that lost or never had this holder) or a
lapse longer than the lease leads to registering again.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError, HolderInfo
from holder.service import HolderService

log = logging.getLogger("corpusd.holder")


def describe(svc: HolderService, address: str) -> HolderInfo:
    geo = svc.pool.geo
    return HolderInfo(
        holder_id=svc.cfg.holder_id,
        address=address,
        device=svc.cfg.device,
        capacity_frames=geo.frames,
        page_size=geo.page_size,
        model_fingerprint=svc.fingerprint,
        dtype=geo.page_format,  # "bfloat16+fp8_e4m3" for fp8 rows: placed only fp8 pins
    )


async def keep_registered(svc: HolderService, coordinator: str, address: str) -> None:
    """Run until cancelled: register, heartbeat every lease/3, re-register when forgotten."""
    me = describe(svc, address)
    client = CoordinatorClient(coordinator, timeout=5.0)
    backoff, lease = 0.2, 0.0
    try:
        while True:
            try:
                if not lease:
                    lease = await client.register(me)
                    log.info(
                        "%s registered with %s (lease %.1f s)", me.holder_id, coordinator, lease
                    )
                    backoff = 0.2
                await asyncio.sleep(lease / 3)
                lease = await client.heartbeat(
                    me.holder_id,
                    svc.pool.used_frames,
                    svc.admission.active,
                    elbow_flows=svc.admission.max_flows,
                    queue_depth=svc.admission.queued,
                    hot_pages=svc.hot_pages(),
                    fanin_mean=svc.admission.mean_fanin(),
                )
            except CoordinatorError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    log.warning("coordinator %s: %s (retrying in %.1f s)", coordinator, e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                lease = 0.0  # register afresh
    finally:
        await client.close()
