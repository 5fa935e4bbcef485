"""The storage half of SGLang's HiCache controller, transcribed (no sglang needed), to drive a
storage backend the way a live server does: from the same threads, in the same order, with the
same signatures and the same error handling.

sglang 0.5.10.post1, ``managers/cache_controller.py``: ``HiCacheController`` runs three daemon
threads per scheduler, each a loop that catches ``queue.Empty`` and nothing else, so a backend
call that raises ends the thread for the life of the server:

- ``prefetch_thread_func`` → ``_storage_hit_query`` → ``batch_exists(keys, extra_info)``; fewer
  hit tokens than ``prefetch_threshold`` revoke the request (``prefetch_revoke_queue``) and free
  its host slots, otherwise the hit pages go to ``prefetch_buffer``;
- ``prefetch_io_aux_func`` → ``_page_transfer`` → ``_page_get_zero_copy`` →
  ``batch_get_v1(keys, host_indices, extra_info)``: the leading Trues count, the first False (or
  fewer pages than asked) terminates the operation;
- ``backup_thread_func`` → ``_page_backup`` → ``_page_set_zero_copy`` →
  ``all(batch_set_v1(keys, host_indices, extra_info))`` per batch of 128 pages; a False ends the
  operation ("Write page to storage: N pages failed"), and the operation is acknowledged
  (``ack_backup_queue``) either way.

The scheduler's side (``mem_cache/hiradix_cache.py``): ``prefetch_from_storage`` issues nothing
for fewer whole-page tokens than ``prefetch_threshold`` (256 unless the extra config says; the
server's warm-up request, 3 tokens, never reaches storage); under ``--hicache-storage-prefetch-
policy wait_complete`` a request waits in the queue until its prefetch is revoked, complete, or
terminated (``check_prefetch_progress`` / ``can_terminate_prefetch``), and a backed-up node stays
host-protected until its acknowledgement is drained (``ongoing_backup``; ``Scheduler.
is_fully_idle`` refuses ``/flush_cache`` while any is left).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Any

import torch

from corpusd.engine.spool import page_hash


@dataclass
class Prefetch:
    """``PrefetchOperation``: the request's page-aligned tokens and their pre-allocated slots."""

    request_id: str
    host_indices: torch.Tensor
    token_ids: list[int]
    last_hash: str | None = None
    hash_value: list[str] = field(default_factory=list)
    completed_tokens: int = 0
    terminated: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def increment(self, n: int) -> bool:
        with self.lock:
            if self.terminated:
                return False
            self.completed_tokens += n
            return True

    def mark_terminate(self) -> None:
        with self.lock:
            self.terminated = True


@dataclass
class Backup:
    """``StorageOperation`` for a backup: a node's host slots and page keys."""

    host_indices: torch.Tensor
    hash_value: list[str]
    completed_tokens: int = 0


class StorageThreads:
    """``HiCacheController``'s storage threads around ``backend`` (attached and registered with
    its host pool by the caller, as ``attach_storage_backend`` does)."""

    def __init__(self, backend: Any, page_size: int = 64, prefetch_threshold: int = 256) -> None:
        self.backend, self.page_size = backend, page_size
        self.prefetch_threshold = max(prefetch_threshold, page_size)
        self.storage_batch_size = 128
        self.stop = threading.Event()
        self.prefetch_queue: Queue[Prefetch | None] = Queue()
        self.prefetch_buffer: Queue[Prefetch | None] = Queue()
        self.backup_queue: Queue[Backup | None] = Queue()
        self.prefetch_revoke_queue: Queue[str] = Queue()
        self.ack_backup_queue: Queue[Backup] = Queue()
        self.host_mem_release_queue: Queue[torch.Tensor] = Queue()
        self.threads = {
            name: threading.Thread(target=fn, daemon=True, name=f"hicache-{name}")
            for name, fn in (
                ("prefetch", self.prefetch_thread_func),
                ("prefetch-io", self.prefetch_io_aux_func),
                ("backup", self.backup_thread_func),
            )
        }
        for t in self.threads.values():
            t.start()

    def close(self) -> None:
        self.stop.set()
        for q in (self.prefetch_queue, self.prefetch_buffer, self.backup_queue):
            q.put(None)
        for t in self.threads.values():
            t.join(timeout=5)

    def alive(self) -> dict[str, bool]:
        return {name: t.is_alive() for name, t in self.threads.items()}

    # -- scheduler side ----------------------------------------------------------------------
    def prefetch(
        self, request_id: str, tokens: list[int], host_indices: torch.Tensor
    ) -> Prefetch | None:
        """``HiRadixCache.prefetch_from_storage`` for a request matched nothing (root node):
        None when the whole pages are too few to ask storage about."""
        n = len(tokens) - len(tokens) % self.page_size
        if n < self.prefetch_threshold:
            return None
        op = Prefetch(request_id, host_indices[:n], tokens[:n])
        self.prefetch_queue.put(op)
        return op

    def wait_prefetch(self, op: Prefetch, timeout: float = 10.0) -> str:
        """The scheduler's wait under ``wait_complete``: "revoked", "complete" or "terminated"
        once the request may be scheduled; "stuck" if it still may not after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        revoked: set[str] = set()
        while time.monotonic() < deadline:
            while True:  # drain_storage_control_queues
                try:
                    revoked.add(self.prefetch_revoke_queue.get_nowait())
                except Empty:
                    break
            if op.request_id in revoked:
                return "revoked"
            n = len(op.hash_value)
            if n and op.completed_tokens == n * self.page_size:
                return "complete"
            if op.terminated:
                return "terminated"
            time.sleep(0.01)
        return "stuck"

    def backup(self, keys: list[str], host_indices: torch.Tensor) -> Backup:
        """``write_backup_storage``: a node's pages, once on the host, offered to storage."""
        op = Backup(host_indices, keys)
        self.backup_queue.put(op)
        return op

    def wait_backup_ack(self, op: Backup, timeout: float = 10.0) -> bool:
        """Whether ``op`` was acknowledged within ``timeout`` s (``_drain_backup``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.ack_backup_queue.get(timeout=0.05) is op:
                    return True
            except Empty:
                pass
        return False

    # -- the threads, as SGLang has them ------------------------------------------------------
    def _extra_info(self) -> Any:
        return SimpleNamespace(prefix_keys=None, extra_info=None)  # HiCacheStorageExtraInfo

    def _storage_hit_query(self, op: Prefetch) -> tuple[list[str], int]:
        last_hash, hashes, count = op.last_hash, [], 0
        step = self.page_size * self.storage_batch_size
        for start in range(0, len(op.token_ids), step):
            batch_tokens = op.token_ids[start : start + step]
            batch = []
            for i in range(0, len(batch_tokens), self.page_size):
                last_hash = page_hash(batch_tokens[i : i + self.page_size], last_hash)
                batch.append(last_hash)
            hit = self.backend.batch_exists(batch, self._extra_info())
            hashes.extend(batch[:hit])
            count += hit * self.page_size
            if hit < len(batch):
                break
        return hashes, count

    def prefetch_thread_func(self) -> None:
        while not self.stop.is_set() or not self.prefetch_queue.empty():
            try:
                op = self.prefetch_queue.get(block=True, timeout=1)
                if op is None:
                    continue
                hashes, hit = self._storage_hit_query(op)
                if hit < self.prefetch_threshold:
                    self.prefetch_revoke_queue.put(op.request_id)
                    self.host_mem_release_queue.put(op.host_indices)
                else:
                    op.hash_value = hashes[: hit // self.page_size]
                    self.host_mem_release_queue.put(op.host_indices[hit:])
                    op.host_indices = op.host_indices[:hit]
                    self.prefetch_buffer.put(op)
            except Empty:
                continue

    def prefetch_io_aux_func(self) -> None:
        while not self.stop.is_set():
            try:
                op = self.prefetch_buffer.get(block=True, timeout=1)
                if op is None:
                    continue
                self._page_transfer(op)
                self.host_mem_release_queue.put(op.host_indices[op.completed_tokens :])
            except Empty:
                continue

    def _page_transfer(self, op: Prefetch) -> None:
        p, b = self.page_size, self.storage_batch_size
        for i in range(0, len(op.hash_value), b):
            keys = op.hash_value[i : i + b]
            slots = op.host_indices[i * p : (i + len(keys)) * p]
            before = op.completed_tokens
            results = self.backend.batch_get_v1(keys, slots, self._extra_info())
            inc = 0
            for ok in results[: len(keys)]:
                if not ok:
                    break
                inc += p
            op.increment(inc)
            if op.completed_tokens != before + len(keys) * p:
                op.mark_terminate()
                break

    def backup_thread_func(self) -> None:
        while not self.stop.is_set():
            try:
                op = self.backup_queue.get(block=True, timeout=1)
                if op is None:
                    continue
                self._page_backup(op)
                self.ack_backup_queue.put(op)
            except Empty:
                continue

    def _page_backup(self, op: Backup) -> None:
        p, b = self.page_size, self.storage_batch_size
        for i in range(0, len(op.hash_value), b):
            keys = op.hash_value[i : i + b]
            slots = op.host_indices[i * p : (i + len(keys)) * p]
            if not all(self.backend.batch_set_v1(keys, slots, self._extra_info())):
                break  # "Write page to storage: N pages failed."
            op.completed_tokens += p * len(keys)
