"""What ``tools/fuzz.py`` found, one test each, in-process: every one of these requests was
answered INTERNAL (or took a daemon down) before its fix."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from corpusd.rpc import Reject
from corpusd.v1 import holder_pb2
from holder.config import HolderConfig
from holder.pool import FramePool, Geometry
from holder.requests import RequestChecks

S = grpc.StatusCode


def _pool(frames: int = 6) -> FramePool:
    pool = FramePool(
        Geometry(2, 4, kv_dim=8, d_v=6, index_dim=3, dtype=torch.float32, frames=frames)
    )
    pool.add_corpus("a", 10, 3)
    for page, frame in zip((0, 1, 2), pool.take_frames(3), strict=True):
        pool.fill("a", page, frame, [torch.ones(4, 8)] * 2, [torch.zeros(4, 3)] * 2)
    return pool


def test_release_naming_a_page_twice_frees_it_once() -> None:
    """Release(pages=[1, 1, …]): KeyError on the second pop → INTERNAL."""
    pool = _pool()
    assert pool.release("a", [1] * 100_000 + [2]) == 2
    assert sorted(pool.corpora["a"].pages) == [0] and pool.free_frames == 5
    pool.check_integrity()


def test_fetch_past_the_message_limit_is_refused_before_it_is_read() -> None:
    """Fetch(pages=[0] × 100k): the holder gathered 100k pages × all layers (29 GB with the
    tiny model) and was killed for memory."""
    pool = _pool()
    cfg = HolderConfig(store="unused", state_dir="unused", max_message_bytes=1000)
    checks = RequestChecks(cfg, pool)
    ok = holder_pb2.FetchRequest(corpus_id="a", pages=[0], layers=[1])  # 4 × 8 × 4 bytes
    assert checks.fetch(ok) == ([1], [pool.corpora["a"].pages[0]])
    big = holder_pb2.FetchRequest(corpus_id="a", pages=[0] * 100_000, index_keys=True)
    with pytest.raises(Reject, match="fetch fewer pages per call") as e:
        checks.fetch(big)
    assert e.value.code == S.RESOURCE_EXHAUSTED
    assert "100,000 pages × 2 layers is 35,200,000 bytes" in str(e.value)


def test_fetch_of_no_pages_answers_empty_tensors() -> None:
    """Fetch(pages=[]): ``view(0, P, -1)`` cannot infer a width → INTERNAL."""
    from holder.reads import PoolReads

    pool = _pool()
    lat, idx = PoolReads(pool).pages([], [0, 1], index_keys=True)
    assert [tuple(t.shape) for t in lat + idx] == [(0, 4, 8), (0, 4, 8), (0, 4, 3), (0, 4, 3)]


def test_assign_of_an_id_that_is_not_one_is_refused_before_it_is_a_path(tmp_path: Path) -> None:
    """Assign(corpus_id="x" × 5000): OSError "File name too long" → INTERNAL; and an id with
    path separators was joined to the store's path as it was."""
    from corpusd.corpus.store import PageStore, StoreError
    from holder.loading import load_pages

    store = PageStore(tmp_path / "store")
    (tmp_path / "manifest.json").write_text("{}")  # what "../.." would have reached
    for bad in ("x" * 5000, "../..", "a/b", "é漢", ""):
        with pytest.raises(Reject, match="is not a corpus id") as e:
            load_pages(_pool(), store, "fp", bad, [])
        assert e.value.code == S.INVALID_ARGUMENT
        assert not store.has(bad)
        with pytest.raises(StoreError, match="is not a corpus id"):
            store.manifest(bad)
    with pytest.raises(Reject, match="not in the store") as e:
        load_pages(_pool(), store, "fp", "0" * 32, [])
    assert e.value.code == S.NOT_FOUND


def test_choose_worker_saturates_a_worker_that_reports_its_counters_at_their_maximum() -> None:
    """ReportWorker(kv_tokens=2⁶⁴−2, kv_capacity=2⁶⁴−1), then ChooseWorker(session_tokens=2):
    the fit is checked in float (it rounds to 1.0, a fit) and the sum stored back in the uint64
    field raised ValueError → INTERNAL."""
    import asyncio
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter

    from corpusd.coordinator.service import CoordinatorService
    from corpusd.v1 import coordinator_pb2 as pb

    requests = Counter("r", "r", ["method", "code"], registry=CollectorRegistry())
    pub = SimpleNamespace(state=None, metrics=SimpleNamespace(requests=requests))
    svc = CoordinatorService(pub, None, lease_s=10.0)  # type: ignore[arg-type]

    class Context:
        async def abort(self, code: grpc.StatusCode, detail: str) -> None:
            raise AssertionError(f"{code}: {detail}")

    async def go() -> list[str]:
        report = pb.WorkerReport(
            worker_id="w", address="a:1", generating=2**32 - 2, max_batch=2**32 - 1,
            kv_tokens=2**64 - 2, kv_capacity=2**64 - 1,
        )  # fmt: skip
        await svc.ReportWorker(report, Context())
        out = []
        for tokens in (2,):
            r = await svc.ChooseWorker(pb.ChooseWorkerRequest(session_tokens=tokens), Context())
            out.append(r.worker_id)
        return out

    assert asyncio.run(go()) == ["w"]
    r, _ = svc.workers["w"]
    assert (r.generating, r.kv_tokens) == (2**32 - 1, 2**64 - 1)


def test_fp8_index_topk_on_keys_not_128_wide_is_refused() -> None:
    """IndexTopK(arith='fp8') on a model whose index keys are 64 wide (the CPU default): the
    fp8 quantizer's assertion surfaced as INTERNAL (found by the fuzz suite on the new default
    model); now INVALID_ARGUMENT naming the width."""
    from corpusd.wire import to_proto

    pool = _pool()
    checks = RequestChecks(HolderConfig(store="unused", state_dir="unused"), pool)
    req = holder_pb2.IndexTopKRequest(
        corpus_id="a", layer=0, k=2, arith="fp8",
        q=to_proto(torch.ones(1, 2, 3)), weights=to_proto(torch.ones(1, 2)),
        limit=to_proto(torch.tensor([10])),
    )  # fmt: skip
    with pytest.raises(Reject, match="multiple of 128 wide; this model's are 3") as e:
        checks.index_topk(req)
    assert e.value.code == S.INVALID_ARGUMENT
    req.arith = "exact"
    assert checks.index_topk(req).arith == "exact"
