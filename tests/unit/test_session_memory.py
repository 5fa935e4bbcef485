"""A closed session leaves nothing behind in the worker. The fuzz run's agent RSS grew 23-27 %
(bench/results/fuzz-cpu.json); this separates the worker's own state from the process's
allocator: sessions opened, decoded and closed in a loop leave no Session object alive and the
count of tensors where it was after the first ones (measured: 1,600 sessions, RSS flat at 539 MiB,
56 tensors). What grows in the fuzz is native memory around large requests (docs/benchmarks.md,
Fuzz)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import torch

from corpusd.corpus.store import PageStore
from corpusd.testing.holders import synthetic_corpus
from requester.sampling import SamplingParams
from requester.session import Session
from requester.worker import Worker

WARM, MORE = 16, 48


def _live() -> tuple[int, int]:
    """Live Session objects and tensors."""
    gc.collect()
    objs = gc.get_objects()
    return (
        sum(1 for o in objs if type(o) is Session),  # type(): no proxy objects asked
        sum(1 for o in objs if issubclass(type(o), torch.Tensor)),
    )


def test_closed_sessions_leave_no_objects_in_the_worker(tmp_path: Path, tiny_dir: Path) -> None:
    from corpusd.model import load_model

    cid = synthetic_corpus(tmp_path / "store", tiny_dir, 200, name="x")
    w = Worker(load_model(tiny_dir, dtype=torch.float32), store=PageStore(tmp_path / "store"))
    w.attach_monolithic(cid)

    async def sessions(n: int, first: int) -> None:
        for i in range(first, first + n):
            s = w.open(cid, [5, 6, 7, i % 200 + 1], params=SamplingParams(max_tokens=2))
            await w.generate([s])
            w.close_session(s.id)

    async def go() -> tuple[tuple[int, int], tuple[int, int]]:
        await sessions(WARM, 0)  # caches, the predicate's windows and metrics fill first
        before = _live()
        await sessions(MORE, WARM)
        return before, _live()

    try:
        (sessions0, tensors0), (sessions1, tensors1) = asyncio.run(go())
    finally:
        asyncio.run(w.close())
    assert sessions0 == sessions1 == 0, (sessions0, sessions1)
    assert tensors1 == tensors0, f"{tensors1 - tensors0} tensors left by {MORE} sessions"
