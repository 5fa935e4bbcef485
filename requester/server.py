"""``corpusd agent``: one decode worker serving the Agent API, health and metrics.

Start-up: model and tokenizer, the page store (corpus tokens for local recompute), the
coordinator (page tables; load reports so it can place sessions) or a fixed list of holders,
then serve. SIGTERM/SIGINT drain: health turns NOT_SERVING, running streams get ``drain_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import torch

from corpusd import env, security
from corpusd.coordinator.client import CoordinatorClient, CoordinatorError, WorkerReport
from corpusd.corpus.store import PageStore
from corpusd.daemon import claim, listen, write_endpoint
from corpusd.model import fingerprint, load_model
from corpusd.tokenizer import load_tokenizer
from corpusd.v1 import agent_pb2_grpc
from requester.agent import AgentService
from requester.config import AgentConfig, WorkerConfig
from requester.metrics import RequesterMetrics
from requester.predicate import Profile
from requester.table_refresh import TableRefresh
from requester.worker import Worker

log = logging.getLogger("corpusd.agent")
SERVICE = "corpusd.v1.Agent"


async def report_load(svc: AgentService, worker_id: str, address: str, metrics_url: str) -> None:
    """Tell the coordinator this worker's load every ``report_s`` (it places sessions by it and
    shows it in ``corpusd status``); a coordinator that is down is retried quietly."""
    assert svc.coordinator is not None
    down = False
    while True:
        report = WorkerReport(
            worker_id=worker_id,
            address=address,
            sessions=len(svc.worker.sessions),
            generating=len(svc.scheduler.streams),
            max_batch=svc.cfg.max_batch,
            kv_tokens=svc.kv_tokens(),
            kv_capacity=svc.cfg.kv_capacity_tokens,
            corpora=tuple(sorted(svc.worker.corpora)),
            metrics_url=metrics_url,
        )
        try:
            svc.lease_s, unpinned = await svc.coordinator.report_worker(report)
            for cid in unpinned:  # unpinned since it was bound: drop its pages and sessions
                svc.unbind(cid, "unpinned")
            if down:
                log.info("coordinator %s is back", svc.coordinator.address)
            down = False
        except CoordinatorError as e:
            if not down:
                log.warning("coordinator %s: %s (retrying)", svc.coordinator.address, e)
            down = True
        await asyncio.sleep(svc.cfg.report_s)


async def watch_profile(worker: Worker, path: Path, every_s: float = 1.0) -> None:
    """Reload the predicate's profile when ``path`` changes (``corpusd up`` calibrates beside
    the agent's start; ``corpusd calibrate`` rewrites it): the next decision uses it. A file
    that is not a profile is logged once and the one in use kept."""
    seen = _mtime(path)
    while True:
        await asyncio.sleep(every_s)
        now = _mtime(path)
        if now == seen or now is None:
            continue
        seen = now
        try:
            profile = Profile.load(path)
        except ValueError as e:
            log.warning("profile not reloaded: %s", e)
            continue
        worker.fanout.predicate.profile = profile
        worker.fanout.drift.profile = profile.source
        log.info("reloaded the cost-model profile %s (%s)", path, profile.source)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def profile_path(path: str) -> Path:
    return Path(path) if path else env.home() / "profile.json"


def load_profile(path: str) -> Profile:
    """The agent's calibration: ``path``, else ``$CORPUSD_HOME/profile.json`` when
    ``corpusd calibrate`` wrote one, else the built-in constants. Raises ValueError for a file
    that is not a profile."""
    p = Path(path) if path else env.home() / "profile.json"
    return Profile.load(p) if path or p.is_file() else Profile()


async def serve(cfg: AgentConfig, wcfg: WorkerConfig, model_dir: Path) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = load_model(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir, model.cfg.bos_token_id, model.cfg.eos_token_id)
    worker = Worker(
        model,
        wcfg,
        store=PageStore(cfg.store),
        profile=load_profile(wcfg.profile),
        metrics=RequesterMetrics(),
    )
    coord = CoordinatorClient(cfg.coordinator, timeout=10.0) if cfg.coordinator else None
    holders = tuple(a.strip() for a in cfg.holders.split(",") if a.strip())
    svc = AgentService(cfg, worker, tok, coord, holders, fingerprint(model_dir))
    http = None
    if cfg.http_port >= 0:
        from requester.http import HttpApi, bind  # starlette and uvicorn: only when served

        tls, tokens = security.http_serving(cfg.host, cfg.http_client_cert)
        http = HttpApi(svc, bind(cfg.host, cfg.http_port), cfg.drain_s, tls, tokens)
    options = [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20),
    ]
    up = await listen(
        lambda srv: agent_pb2_grpc.add_AgentServicer_to_server(svc, srv),
        SERVICE,
        cfg.host,
        cfg.port,
        cfg.metrics_port,
        worker.metrics.registry,
        options,
    )
    metrics_port = up.metrics_port
    address = f"{cfg.host}:{up.port}"
    worker_id = cfg.worker_id or f"agent-{up.port}"
    if http is not None:
        http.start()
        web = "https" if tls else "http"
        log.info("%s: OpenAI-compatible API on %s://%s:%d/v1", worker_id, web, cfg.host, http.port)
    write_endpoint(
        Path(cfg.state_dir),
        {
            "worker_id": worker_id,
            "address": address,
            "metrics_port": metrics_port,
            "http_port": http.port if http is not None else -1,
            "pid": os.getpid(),
        },
    )
    log.info(
        "%s serving on %s (model %s, indexer %s, primitive %s, %s); metrics on :%d",
        worker_id,
        address,
        model_dir,
        wcfg.indexer,
        wcfg.primitive,
        f"coordinator {cfg.coordinator}" if coord else f"holders {', '.join(holders) or 'none'}",
        metrics_port,
    )
    tasks = [asyncio.create_task(watch_profile(worker, profile_path(wcfg.profile)))]
    tasks.append(asyncio.create_task(svc.expire_idle_loop()))
    if coord is not None:
        url = f"{up.scheme}://{cfg.host}:{metrics_port}/metrics" if metrics_port >= 0 else ""
        tasks.append(asyncio.create_task(report_load(svc, worker_id, address, url)))
        if cfg.table_refresh_s != -1:
            refresh = TableRefresh(worker, coord)
            tasks.append(asyncio.create_task(refresh.run(svc.table_refresh_s)))
    await up.until_signal(
        worker_id, cfg.drain_s, tasks, http.stop_accepting if http is not None else None
    )
    if http is not None:
        await http.stopped(cfg.drain_s)
    await svc.close()
    await worker.close()
    if coord is not None:
        await coord.close()
    log.info("%s stopped", worker_id)


def ports(cfg: AgentConfig) -> dict[str, int]:
    """The ports it binds, by flag (checked free before anything is written)."""
    return {"--port": cfg.port, "--metrics-port": cfg.metrics_port, "--http-port": cfg.http_port}


def run(cfg: AgentConfig, wcfg: WorkerConfig, model_dir: Path) -> None:
    claim(Path(cfg.state_dir), "agent", cfg.host, ports(cfg))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.run(serve(cfg, wcfg, model_dir))
    except ImportError:  # uvloop is not built for every platform; asyncio's loop serves too
        asyncio.run(serve(cfg, wcfg, model_dir))
