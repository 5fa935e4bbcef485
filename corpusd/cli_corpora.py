"""``corpusd status``, ``ls``, ``unpin`` and ``rm``: the corpora a coordinator or a local page
store holds, listed and removed (the CLI's corpus-management commands; the store is imported when
one runs, as in :mod:`corpusd.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corpusd import env
from corpusd.cli_pin import count, mib
from corpusd.coordinator.client import CoordinatorClient, CorpusStatus, Removal
from corpusd.coordinator.config import StatusConfig


def bounded(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``cmd`` (a command of a few calls, each with deadline ``--timeout-s``) ended with status 1
    if it runs far past them all (:func:`hang_bound`), every thread's stack printed to stderr
    first (faulthandler): a script calling it never waits forever, and the stacks say where it
    stood (grpc.aio's teardown hung one such run once: docs/testing.md). The timer is disarmed
    when ``cmd`` returns."""

    @functools.wraps(cmd)
    def run(a: argparse.Namespace) -> int:
        armed = _arm(hang_bound(a.timeout_s))
        try:
            return cmd(a)
        finally:
            if armed:
                faulthandler.cancel_dump_traceback_later()

    return run


def _arm(seconds: float) -> bool:
    """faulthandler's timer on the process's own fd 2 (even where ``sys.stderr`` is a buffer);
    False where there is no such file."""
    err = sys.__stderr__
    if err is None:
        return False
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=err)
    except (ValueError, OSError, AttributeError):  # no file descriptor
        return False
    return True


def hang_bound(timeout_s: float) -> float:
    """When a command of calls with deadline ``timeout_s`` counts as hung: far past them all."""
    return 4 * timeout_s + 30


@bounded
def cmd_status(a: argparse.Namespace) -> int:
    from corpusd.coordinator.status import as_json, render

    cfg = StatusConfig(coordinator=env.coordinator(a.coordinator), timeout_s=a.timeout_s)

    async def fetch() -> tuple[list[Any], list[Any], list[Any]]:
        async with CoordinatorClient(cfg.coordinator, timeout=cfg.timeout_s) as c:
            return await c.list_holders(), await c.list_corpora(), await c.list_workers()

    holders, corpora, workers = asyncio.run(fetch())
    if a.json:
        keys = ("coordinator", "holders", "corpora", "workers")
        print(as_json(dict(zip(keys, (cfg.coordinator, holders, corpora, workers), strict=True))))
    else:
        print(f"coordinator {cfg.coordinator}\n" + render(holders, corpora, workers))
    return 0


@bounded
def cmd_ls(a: argparse.Namespace) -> int:
    """The coordinator's corpora (and those of its store it was never asked to pin); with no
    coordinator, the local page store's."""
    from corpusd.coordinator.status import as_json, render_corpora

    address, source = env.coordinator_source(a.coordinator)
    if address:

        async def fetch() -> list[CorpusStatus]:
            async with CoordinatorClient(address, timeout=a.timeout_s) as c:
                return await c.list_corpora(stored=True)

        corpora, where = asyncio.run(fetch()), f"coordinator {address}"
    else:
        store = Path(a.store).expanduser() if a.store else env.default_store_dir()
        corpora, where = _stored(store), f"page store {store} (no coordinator: {source})"
    print(as_json(corpora) if a.json else f"{where}\n{render_corpora(corpora)}")
    return 0


def _stored(root: Path) -> list[CorpusStatus]:
    """A local page store's corpora, as ``ls`` lists them (state ``stored``)."""
    from corpusd.corpus.store import PageStore

    if not (root / "corpora").is_dir():
        return []
    store, out = PageStore(root), []
    for cid in store.ids():
        m = store.manifest(cid)
        out.append(
            CorpusStatus(
                corpus_id=cid,
                name=m.name,
                state="stored",
                tokens=m.token_count,
                pages=m.n_pages,
                page_size=m.page_size,
                cp_degree=0,
                replicas=0,
                model_fingerprint=m.model_fingerprint,
                holder_ids=(),
                expired_holders=(),
                queue_position=0,
                created_at=m.created_at,
                state_age_s=time.time() - (store.corpora / cid).stat().st_mtime,
            )
        )
    return out


def _coordinator(flag: str) -> str:
    address = env.coordinator(flag)
    if not address:
        raise ValueError(env.NO_COORDINATOR)
    return address


@bounded
def cmd_unpin(a: argparse.Namespace) -> int:
    """Off every holder and out of the page table (``--delete``: out of the store too)."""
    address = _coordinator(a.coordinator)

    async def go() -> Removal:
        async with CoordinatorClient(address, timeout=a.timeout_s) as c:
            return await c.unpin_corpus(a.corpus, a.delete)

    r = asyncio.run(go())
    c, what = r.corpus, f"{r.corpus.name} (corpus {r.corpus.corpus_id})"
    if c.state == "retired" and not a.delete:
        raise ValueError(
            f"{what} is not pinned: it was unpinned earlier; nothing changed "
            f"(`corpusd rm {a.corpus}` deletes it from the page store)"
        )
    if c.state == "retired":
        line = f"{what} was not pinned"
    elif c.state == "queued":
        line = f"withdrew the queued pin of {what}"
    else:
        on = f" on {', '.join(c.holder_ids)}" if c.holder_ids else ""
        line = f"unpinned {what}: released {count(r.frames_freed, 'frame')}{on}"
    if a.delete:
        line += (
            f"; deleted it from the page store ({mib(r.bytes_deleted)})"
            if r.deleted
            else "; its files were already gone from the page store"
        )
    print(line)
    return 0


@bounded
def cmd_rm(a: argparse.Namespace) -> int:
    """Delete an unpinned corpus from the coordinator's page store (refused while pinned); with
    no coordinator, from the local page store."""
    address, source = env.coordinator_source(a.coordinator)
    if address:

        async def go() -> Removal:
            async with CoordinatorClient(address, timeout=a.timeout_s) as c:
                return await c.delete_corpus(a.corpus)

        r = asyncio.run(go())
        what = f"{r.corpus.name} (corpus {r.corpus.corpus_id})"
        print(
            f"deleted {what} from the page store of {address} ({mib(r.bytes_deleted)})"
            if r.deleted
            else f"forgot {what}: its files were already gone from the page store"
        )
        return 0
    from corpusd.corpus.store import PageStore, StoreError

    root = Path(a.store).expanduser() if a.store else env.default_store_dir()
    if not (root / "corpora").is_dir():
        raise StoreError(f"no page store at {root}")
    store = PageStore(root)
    cid = store.resolve(a.corpus)
    name = store.manifest(cid).name
    size = store.delete(cid)
    print(
        f"deleted {name} (corpus {cid}) from {root} ({mib(size)}); no coordinator was asked "
        f"whether it is pinned ({source})"
    )
    return 0
