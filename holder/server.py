"""``corpusd holder``: one process per device serving the Holder service, health and metrics.

Start-up: pool geometry from the model, kernel chosen by capability, assignments restored from
the state directory into the same frames, then serve. SIGTERM/SIGINT drain: health turns
NOT_SERVING, new RPCs are refused, running ones get ``drain_s`` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import replace
from pathlib import Path

import grpc
import torch

from corpusd.corpus.store import PageStore
from corpusd.daemon import claim, listen, write_endpoint
from corpusd.kernels import fp8_cache
from corpusd.kernels.registry import choose
from corpusd.model import ModelConfig, fingerprint
from corpusd.v1 import holder_pb2_grpc
from holder.config import HolderConfig
from holder.metrics import HolderMetrics
from holder.pool import FramePool, Geometry
from holder.registration import keep_registered
from holder.service import HolderService

log = logging.getLogger("corpusd.holder")
SERVICE = "corpusd.v1.Holder"
INTEGRITY_EVERY_S = 30.0


def build(cfg: HolderConfig, model_dir: Path, mcfg: ModelConfig) -> HolderService:
    """The service for the model in ``model_dir`` (its config ``mcfg``, read once by ``serve``)."""
    geo = Geometry(
        n_layers=mcfg.num_hidden_layers,
        page_size=cfg.page_size,
        kv_dim=mcfg.kv_dim,
        d_v=mcfg.kv_lora_rank,
        index_dim=mcfg.index_head_dim,
        dtype=getattr(torch, cfg.dtype),
        frames=cfg.frames,
        device=cfg.device,
        kv_format=cfg.kv_format,
    )
    if cfg.capacity_bytes:
        frames = cfg.capacity_bytes // geo.bytes_per_frame
        if frames < 1:
            raise ValueError(
                f"capacity_bytes {cfg.capacity_bytes:,} is less than one frame "
                f"({geo.bytes_per_frame:,} bytes)"
            )
        geo = replace(geo, frames=frames)
    if geo.fp8:
        fp8_cache.check_layout(mcfg.kv_lora_rank, mcfg.qk_rope_head_dim)
    kernel = choose(cfg.kernel, cfg.device, geo.dtype, geo.kv_dim, geo.d_v, geo.kv_format)
    return HolderService(
        cfg, FramePool(geo), PageStore(cfg.store), kernel, fingerprint(model_dir), HolderMetrics()
    )


async def _integrity_loop(svc: HolderService) -> None:
    while True:
        await asyncio.sleep(INTEGRITY_EVERY_S)
        if svc.admission.active == 0 and not svc._mutate.locked():
            svc.pool.check_integrity()


def _stable_id(state_dir: Path, fresh: str) -> str:
    """The id a previous run in this state dir used: the coordinator's page table names holders
    by id, and a restart on another port still holds the same frames."""
    path = state_dir / "holder_id"
    if path.is_file():
        return path.read_text().strip()
    path.write_text(fresh + "\n")
    return fresh


async def serve(cfg: HolderConfig, model_dir: Path) -> None:
    if cfg.host_threads:
        torch.set_num_threads(cfg.host_threads)
    mcfg = ModelConfig.from_dir(model_dir)
    svc = build(cfg, model_dir, mcfg)
    restored = await asyncio.get_running_loop().run_in_executor(None, svc.restore)
    svc.pool.check_integrity()
    limit = cfg.max_message_bytes + (1 << 20)
    endpoint_nv = None
    if cfg.nvshmem_peers:
        from holder.nvshmem_endpoint import from_config

        endpoint_nv = from_config(cfg, svc.pool, svc.kernel, mcfg.num_attention_heads)
        g = endpoint_nv.ring
        log.info(
            "offering NVSHMEM job %s: %d requester slot(s), ring depth %d, %d / %d bytes per "
            "request / reply slot",
            endpoint_nv.job_id,
            g.peers,
            g.depth,
            g.req_bytes,
            g.rep_bytes,
        )
    svc.metrics.transport.labels("grpc").set(1)
    svc.metrics.transport.labels("nvshmem").set(1 if endpoint_nv is not None else 0)

    def add(server: grpc.aio.Server) -> None:
        holder_pb2_grpc.add_HolderServicer_to_server(svc, server)
        if endpoint_nv is not None:
            from corpusd.v1 import transport_pb2_grpc

            transport_pb2_grpc.add_TransportServicer_to_server(endpoint_nv, server)

    up = await listen(
        add,
        SERVICE,
        cfg.host,
        cfg.port,
        cfg.metrics_port,
        svc.metrics.registry,
        [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
    )
    port, metrics_port = up.port, up.metrics_port
    # A name, not the first port: a restart on another port keeps it (status showed
    # holder-35333 at :46701 before)
    holder_id = cfg.holder_id or _stable_id(Path(cfg.state_dir), f"holder-{secrets.token_hex(3)}")
    svc.cfg = cfg = replace(cfg, holder_id=holder_id)
    # what peers dial: the address in front of it when one is given (NAT, load balancer, proxy)
    advertised = cfg.advertise or f"{cfg.host}:{port}"
    write_endpoint(
        Path(cfg.state_dir),
        {
            "holder_id": holder_id,
            "address": f"{cfg.host}:{port}",
            "metrics_port": metrics_port,
            "pid": os.getpid(),
            "kernel": svc.kernel.name,
            "device": cfg.device,
            "advertise": advertised,
        },
    )
    log.info(
        "%s serving on %s:%d, advertised as %s (kernel %s, device %s, pages %s, %d frames of "
        "%d, restored %d pages); metrics on :%d",
        holder_id,
        cfg.host,
        port,
        advertised,
        svc.kernel.name,
        cfg.device,
        svc.pool.geo.page_format,
        svc.pool.geo.frames,
        cfg.page_size,
        restored,
        metrics_port,
    )

    checker = asyncio.create_task(_integrity_loop(svc))
    tasks = [checker]
    if cfg.coordinator:
        tasks.append(asyncio.create_task(keep_registered(svc, cfg.coordinator, advertised)))
    await up.until_signal(holder_id, cfg.drain_s, tasks)
    svc.executor.shutdown(wait=True)
    left = True
    if endpoint_nv is not None and endpoint_nv.job is not None:
        left = endpoint_nv.close()  # collective: bounded, since requesters may be gone
    log.info("%s stopped", holder_id)
    if not left:
        logging.shutdown()
        os._exit(0)


def ports(cfg: HolderConfig) -> dict[str, int]:
    """The ports it binds, by flag (checked free before anything is written)."""
    return {"--port": cfg.port, "--metrics-port": cfg.metrics_port}


def run(cfg: HolderConfig, model_dir: Path) -> None:
    claim(Path(cfg.state_dir), "holder", cfg.host, ports(cfg))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.run(serve(cfg, model_dir))
    except ImportError:  # uvloop is not built for every platform; asyncio's loop serves too
        asyncio.run(serve(cfg, model_dir))
