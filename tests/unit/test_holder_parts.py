"""Holder pieces in-process: the frame pool's bookkeeping, request checks and the CPU Attend
compute, admission, generated protos."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from corpusd.kernels.reference import partial_attention
from corpusd.kernels.registry import Kernel
from corpusd.rpc import Reject
from corpusd.v1 import holder_pb2
from corpusd.wire import to_proto
from holder.admission import Admission, Overloaded
from holder.config import HolderConfig
from holder.partials import partial_cpu
from holder.pool import FramePool, Geometry, PoolFull, RowError, rows_outside
from holder.requests import RequestChecks

ROOT = Path(__file__).resolve().parents[2]


def _pool(frames: int = 6) -> FramePool:
    return FramePool(
        Geometry(2, 4, kv_dim=8, d_v=6, index_dim=3, dtype=torch.float32, frames=frames)
    )


def _fill(pool: FramePool, cid: str, pages: list[int], tokens: int) -> dict[int, int]:
    pool.add_corpus(cid, tokens, -(-tokens // 4))
    frames = pool.take_frames(len(pages))
    for page, frame in zip(pages, frames, strict=True):
        lat = [torch.full((4, 8), float(page)) for _ in range(2)]
        pool.fill(cid, page, frame, lat, [torch.zeros(4, 3)] * 2)
    return dict(zip(pages, frames, strict=True))


def test_row_mask_accepts_exactly_what_check_rows_accepts_and_follows_changes() -> None:
    pool = _pool()
    a = _fill(pool, "a", [0, 2], tokens=10)  # page 2 (the last) holds 2 valid rows
    _fill(pool, "b", [0], tokens=4)

    def accepted(cid: str) -> set[int]:
        ok = set()
        for row in range(24):
            try:
                pool.check_rows(cid, torch.tensor([[row]]))
                ok.add(row)
            except RowError:
                pass
        return ok

    mask = pool.row_mask("a", "cpu")
    assert set(mask.nonzero().squeeze(1).tolist()) == accepted("a")
    assert pool.row_mask("a", "cpu") is mask, "cached while the pool is unchanged"
    _fill(pool, "a", [1], tokens=10)  # a new page of a: the mask must grow
    assert set(pool.row_mask("a", "cpu").nonzero().squeeze(1).tolist()) == accepted("a")
    pool.release("a", [0])
    rows = set(pool.row_mask("a", "cpu").nonzero().squeeze(1).tolist())
    assert rows == accepted("a") and not rows & set(range(4 * a[0], 4 * a[0] + 4))
    pool.release("a")
    with pytest.raises(KeyError):
        pool.row_mask("a", "cpu")


def test_rows_outside_rejects_exactly_what_check_rows_rejects() -> None:
    """The device-side check (GPU gRPC Attend, NVSHMEM requests) against the host one."""
    pool = _pool()
    _fill(pool, "a", [0, 2], tokens=10)
    _fill(pool, "b", [0], tokens=4)
    mask = pool.row_mask("a", "cpu")
    for dtype in (torch.int32, torch.int64):  # int32 is what requesters send, read as is
        for row in range(-3, 30):
            rows = torch.tensor([[-1, row]], dtype=dtype)
            try:
                pool.check_rows("a", rows)
                host_ok = True
            except RowError:
                host_ok = False
            assert bool(rows_outside(mask, rows)) is not host_ok, (row, dtype)


def test_attend_rows_stay_int32_from_the_request_to_the_kernel() -> None:
    """The holder's CPU Attend path never widens the requester's int32 rows, and the result is
    bit-identical to the reference over the same rows as int64."""
    g = torch.Generator().manual_seed(16)
    pool = FramePool(Geometry(1, 4, kv_dim=72, d_v=8, index_dim=3, dtype=torch.float32, frames=4))
    pool.add_corpus("a", 10, 3)
    for page, frame in zip((0, 1, 2), pool.take_frames(3), strict=True):
        pool.fill("a", page, frame, [torch.randn(4, 72, generator=g)], [torch.zeros(4, 3)])
    q = torch.randn(3, 2, 72, generator=g)
    rows = torch.tensor([[0, 5, -1], [9, 1, 2], [-1, -1, -1]], dtype=torch.int32)
    cfg = HolderConfig(store="unused", state_dir="unused")
    request = holder_pb2.AttendRequest(
        corpus_id="a", layer=0, q=to_proto(q), rows=to_proto(rows), scale=0.1
    )
    call = RequestChecks(cfg, pool).attend(request, on_device=False)
    assert call.rows.dtype == torch.int32
    seen: list[torch.dtype] = []

    def spy(
        q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(idx.dtype)
        return partial_attention(q, kv, idx, scale, d_v)

    o, lse, _ = partial_cpu(pool, Kernel("spy", spy, lambda device: True, 0), call)
    ref_o, ref_lse = partial_attention(q, pool.latent[0], rows.to(torch.int64), 0.1, 8)
    assert seen == [torch.int32]
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    assert torch.isinf(lse[2]).all() and not o[2].any()  # a row with no valid index
    bad = holder_pb2.AttendRequest(
        corpus_id="a", layer=0, q=to_proto(q), rows=to_proto(rows + 12), scale=0.1
    )
    with pytest.raises(Reject, match="outside the pool") as e:
        RequestChecks(cfg, pool).attend(bad, on_device=False)
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_pool_bookkeeping_and_integrity() -> None:
    pool = _pool()
    a = _fill(pool, "a", [0, 1, 2], tokens=10)  # last page holds 2 valid rows
    b = _fill(pool, "b", [0], tokens=4)
    pool.check_integrity()
    assert pool.used_frames == 4 and sorted(a.values()) == [0, 1, 2] and b == {0: 3}
    pool.check_rows("a", torch.tensor([[0, 4 * a[2] + 1, -1]]))
    with pytest.raises(RowError, match="past the corpus's last token"):
        pool.check_rows("a", torch.tensor([[4 * a[2] + 2]]))
    with pytest.raises(RowError, match="not in a frame of corpus a"):
        pool.check_rows("a", torch.tensor([[4 * b[0]]]))
    with pytest.raises(RowError, match="outside the pool"):
        pool.check_rows("a", torch.tensor([[24]]))
    assert pool.release("a", [1]) == 1
    pool.check_integrity()
    again = _fill(pool, "c", [0], tokens=4)
    assert again == {0: a[1]}, "the lowest free frame is reused first"
    with pytest.raises(PoolFull):
        pool.take_frames(5)
    pool.release("a")
    pool.release("b")
    pool.release("c")
    pool.check_integrity()
    assert pool.free_frames == 6 and not pool.corpora
    # integrity catches corruption
    _fill(pool, "d", [0], tokens=4)
    pool.owner[0] = 7
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_admission_caps_flows_queues_in_order_and_times_out() -> None:
    async def go() -> None:
        adm = Admission(max_flows=2, max_queue=2, queue_timeout_s=0.2)
        order: list[int] = []
        gate = asyncio.Event()

        async def flow(i: int) -> None:
            async with adm.slot():
                order.append(i)
                await gate.wait()

        tasks = [asyncio.create_task(flow(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert adm.active == 2 and adm.queued == 2 and order == [0, 1]
        with pytest.raises(Overloaded, match="queued"):
            async with adm.slot():
                pass
        gate.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3] and adm.active == 0 and adm.queued == 0
        # a waiter that times out leaves no slot behind
        gate.clear()
        blockers = [asyncio.create_task(flow(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="waited"):
            async with adm.slot():
                pass
        gate.set()
        await asyncio.gather(*blockers)
        assert adm.active == 0 and adm.queued == 0

    asyncio.run(go())


def test_generated_protos_are_current() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tools.gen_protos", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_shared_pool_keeps_released_frames_out_of_reuse_for_its_delay(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An SGLang worker on the holder's GPU reads a shared pool in place, and a request running
    across its corpus's unpin goes on reading that corpus's frames. Such a pool's released frames
    wait ``reuse_delay_s`` before another corpus fills them: new pages take other free frames,
    and cooling ones only when the pool is otherwise full (oldest first, logged). Capacity as
    the coordinator counts it does not change; an unshared pool reuses at once, as before."""
    import holder.pool as pool_mod

    now = [1000.0]
    monkeypatch.setattr(pool_mod.time, "monotonic", lambda: now[0])
    plain = _pool(4)
    a = _fill(plain, "a", [0, 1], 8)
    plain.release("a")
    assert sorted(plain.take_frames(2)) == sorted(a.values())  # lowest frames first, at once

    pool = _pool(4)
    pool.reuse_delay_s = 30.0
    a = _fill(pool, "a", [0, 1], 8)
    assert sorted(a.values()) == [0, 1]
    pool.release("a")
    assert pool.free_frames == 4 and pool.used_frames == 0 and pool.cooling_frames == 2
    pool.check_integrity()
    b = _fill(pool, "b", [0], 4)
    assert b == {0: 2}  # not a's frames, while another is free
    now[0] += 10
    with caplog.at_level(logging.WARNING, logger="corpusd.holder"):
        c = _fill(pool, "c", [0, 1], 8)  # one free frame left, then a's oldest
    assert sorted(c.values()) == [0, 3] and "pool short of frames: 1" in caplog.text
    assert pool.cooling_frames == 1
    pool.check_integrity()
    with pytest.raises(PoolFull):
        pool.take_frames(2)
    now[0] += 20  # a's delay has passed: its last frame is free again
    assert pool.take_frames(1) == [1] and pool.cooling_frames == 0
