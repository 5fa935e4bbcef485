"""The corpusd HiCache backend driven from SGLang's storage threads (a transcription of
``HiCacheController``'s, :mod:`tests.support.hicache_controller`) over a host pool shaped as
SGLang's: what a live server does with it, in capture and in fetch mode, including the failures
a server meets (a full disk under the spool, a corpus removed from the store while the server
runs). SGLang's storage threads catch nothing but ``queue.Empty``: the backend must answer, never
raise, or the thread is gone for the life of the server."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from corpusd.corpus.store import PageStore
from corpusd.engine import spool
from requester.sglang.pagehash import page_hashes
from tests.support.hicache_controller import StorageThreads
from tests.support.sglang_host import FakeNSAHostPool, load_hicache

P, LAYERS = 64, 2


@pytest.fixture
def hicache(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_hicache(monkeypatch)


def _backend(hicache: ModuleType, host: FakeNSAHostPool, **extra: Any) -> Any:
    cfg = SimpleNamespace(
        extra_config={"model_fingerprint": "sha256:test", "model_path": "/m", **extra},
        model_name="/m",
        tp_rank=0,
    )
    backend = hicache.CorpusdHiCacheStorage(cfg, {})
    backend.register_mem_pool_host(host)  # HiCacheController.attach_storage_backend
    return backend


@pytest.fixture
def threads() -> Iterator[list[StorageThreads]]:
    made: list[StorageThreads] = []
    yield made
    for t in made:
        t.close()


def _slots(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(pg * P, pg * P + P) for pg in pages])


def test_warm_up_and_pin_requests_in_capture_mode_never_wait_on_storage(
    hicache: ModuleType, tmp_path: Path, threads: list[StorageThreads]
) -> None:
    """SGLang's warm-up (3 tokens) issues no prefetch at all; a long prompt's prefetch is
    revoked by the prefetch thread (``batch_exists`` is 0), so under ``wait_complete`` it is
    scheduled as soon as the scheduler drains the revoke; nothing is read from the backend."""
    host = FakeNSAHostPool("layer_first", "bfloat16", LAYERS, page_num=64)
    backend = _backend(hicache, host, corpusd_capture=str(tmp_path / "spool"))
    assert spool.EngineInfo.read(tmp_path / "spool").n_layers == LAYERS
    ct = StorageThreads(backend)
    threads.append(ct)
    assert ct.prefetch("warmup", [10, 11, 12], _slots(0)) is None
    tokens = list(range(1000, 1000 + 20 * P + 5))
    op = ct.prefetch("pin", tokens, _slots(*range(20)))
    assert op is not None and ct.wait_prefetch(op) == "revoked"
    assert backend.batch_get_v1(page_hashes(tokens)[:2], _slots(0, 1)) == [False, False]
    assert all(ct.alive().values())


def test_a_capture_write_that_fails_is_a_failed_write_not_a_dead_backup_thread(
    hicache: ModuleType, tmp_path: Path, threads: list[StorageThreads],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A page that cannot be spooled (the disk is full) fails that backup, which SGLang logs and
    acknowledges; the next backup is captured. Raising instead ended SGLang's backup thread: no
    backup was acknowledged again (``ongoing_backup`` never drains, ``/flush_cache`` is refused
    from then on) and no page reached the spool again."""
    host = FakeNSAHostPool("layer_first", "bfloat16", LAYERS, page_num=8)
    host.kv_buffer.normal_()
    sp = tmp_path / "spool"
    backend = _backend(hicache, host, corpusd_capture=str(sp))
    ct = StorageThreads(backend)
    threads.append(ct)
    real = spool.write_page

    def full_disk(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    keys = page_hashes(list(range(4 * P)))
    monkeypatch.setattr(spool, "write_page", full_disk)
    first = ct.backup(keys[:2], _slots(5, 2))
    assert ct.wait_backup_ack(first), f"the failed backup was never acknowledged: {ct.alive()}"
    assert first.completed_tokens == 0
    monkeypatch.setattr(spool, "write_page", real)
    second = ct.backup(keys[2:], _slots(3, 7))
    assert ct.wait_backup_ack(second), f"the next backup was never acknowledged: {ct.alive()}"
    assert second.completed_tokens == 2 * P
    for key, page in zip(keys[2:], (3, 7), strict=True):
        kv, _ = spool.read_page(sp, key)
        assert torch.equal(kv, host.kv_buffer[:, page * P : page * P + P, 0])
    assert not spool.page_path(sp, keys[0]).exists()
    assert all(ct.alive().values())


def test_a_page_the_store_lost_is_a_miss_not_a_stuck_request(
    hicache: ModuleType, tmp_path: Path, threads: list[StorageThreads]
) -> None:
    """Fetch mode: a page the index lists but the store no longer has (its corpus removed while
    the server runs) ends that prefetch as a miss; the request is scheduled (it computes the
    page) and the next prefetch is served. Raising instead ended SGLang's prefetch I/O thread,
    and under ``wait_complete`` that request, and every later one storage had pages for, waited
    forever."""
    PageStore(tmp_path / "store")
    host = FakeNSAHostPool("layer_first", "bfloat16", LAYERS, page_num=32)
    backend = _backend(hicache, host, corpusd_store=str(tmp_path / "store"))
    backend._key_ue8m0 = False  # what the server found on its first read (needs sglang)
    tokens = list(range(5 * P))
    for p, key in enumerate(page_hashes(tokens)):
        backend.corpus_pages.pages[key] = ("0" * 32, p)  # indexed, then removed from the store
    ct = StorageThreads(backend)
    threads.append(ct)
    for rid in ("first", "second"):
        op = ct.prefetch(rid, tokens, _slots(*range(5)))
        assert op is not None
        assert ct.wait_prefetch(op) == "terminated", f"{rid}: {ct.alive()}"
        assert op.completed_tokens == 0
    assert all(ct.alive().values())
