"""Transports: the registry's choice (CPU), the ring's byte layout (CPU), and on two GPUs the
NVSHMEM route against gRPC Attend through real holder and requester processes (``-m gpu``): the
bench's holder, and a live ``corpusd holder --nvshmem-peers`` serving decode workers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from corpusd.testing.holders import pin_sample, start_holder
from corpusd.transport import Peer, choose
from corpusd.transport import nvshmem_ring as nr
from requester.holder_client import HolderClient

ROOT = Path(__file__).resolve().parents[2]


def test_registry_falls_back_to_grpc_without_a_shared_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NVSHMEM_IB_ENABLE_IBGDA", raising=False)
    assert choose("auto", Peer(nvshmem_job="", same_node=True)).name == "grpc"
    # another node and no IBGDA: NVSHMEM cannot reach it, whatever the holder offers
    assert choose("auto", Peer(nvshmem_job="h:1:x", same_node=False)).name == "grpc"
    with pytest.raises(ValueError, match="not usable"):
        choose("nvshmem", Peer(nvshmem_job="", same_node=True))
    with pytest.raises(ValueError, match="unknown transport"):
        choose("rdma", Peer(nvshmem_job="", same_node=True))


@pytest.mark.skipif(not nr.available(), reason="needs nvshmem4py and a CUDA GPU")
def test_registry_picks_nvshmem_when_both_ends_share_a_job() -> None:
    assert choose("auto", Peer(nvshmem_job="h:1:x", same_node=True)).name == "nvshmem"


def test_ring_slots_hold_the_largest_request_and_reply() -> None:
    g = nr.RingGeometry.for_shapes(peers=2, depth=2, rows=64, heads=128, topk=2048, fetch_rows=4096)
    assert g.req_bytes >= 64 * 128 * 576 * 2 + 64 * 2048 * 4
    assert g.rep_bytes >= 64 * 128 * (512 * 2 + 4) + 4 and g.rep_bytes >= 4096 * 576 * 2 + 4
    slot = torch.zeros(g.req_bytes, dtype=torch.uint8)
    q, idx = nr.attend_request_views(slot, 3, 5, 7)
    q.fill_(1.5)
    idx.fill_(-1)
    # the two views do not overlap and sit where the holder reads them
    assert float(q.float().sum()) == 1.5 * 3 * 5 * 576 and int(idx.sum()) == -21
    rep = torch.zeros(g.rep_bytes, dtype=torch.uint8)
    o, lse, status = nr.attend_reply_views(rep, 3, 5)
    o.fill_(2.0)
    lse.fill_(float("-inf"))
    status.fill_(7)
    assert float(o.float().sum()) == 2.0 * 3 * 5 * 512
    assert bool(torch.isinf(lse).all()) and int(status) == 7


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not nr.available(),
    reason="needs two CUDA GPUs and nvshmem4py (.gpu-deps)",
)
def test_nvshmem_route_equals_grpc_attend(tmp_path: Path) -> None:
    """Real processes: a holder on GPU 1 (gRPC Holder + NVSHMEM Transport) and a requester on
    GPU 0. The NVSHMEM route must return the gRPC Attend's bits, reject rows outside the corpus,
    and keep the reference's empty-row LSE (-inf)."""
    out = tmp_path / "pair.json"
    env = {**os.environ, "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench_gpu", "pair", "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exact = json.loads(out.read_text())["exact"]
    assert exact["nvshmem_equals_grpc_bitwise"], exact
    assert exact["bad_rows_rejected"], exact
    assert exact["rel_err_vs_torch"] < 1e-2, exact
    assert exact["empty_row_lse"] == float("-inf"), exact


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not nr.available(),
    reason="needs two CUDA GPUs and nvshmem4py (.gpu-deps)",
)
def test_decode_worker_routes_over_nvshmem_to_a_live_holder(tmp_path: Path, tiny_dir: Path) -> None:
    """``corpusd holder --nvshmem-peers 1`` on GPU 1; decode workers on GPU 0, one forced to gRPC
    and one to NVSHMEM (``tests/gpu/nvshmem_worker.py``): same tokens, logits and partials, bit
    for bit; rows outside the corpus refused alike; the holder keeps serving once its NVSHMEM
    requester is gone, and its drain does not hang on it."""
    cid = pin_sample(tmp_path, tiny_dir, tokens=700, dtype="bfloat16")
    nv_env = {"NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
    holder = start_holder(
        tmp_path / "store", tmp_path / "holder", tiny_dir,
        "--device", "cuda:0", "--dtype", "bfloat16", "--capacity-tokens", "4096",
        "--nvshmem-peers", "1",
        env={**os.environ, **nv_env, "CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip
    log = tmp_path / "holder" / "holder.log"
    try:

        async def assign() -> tuple[dict[int, int], str]:
            c = HolderClient(holder.address)
            try:
                return await c.assign(cid), (await c.info()).kernel
            finally:
                await c.close()

        frames, kernel = asyncio.run(assign())
        assert frames == {p: p for p in range(len(frames))}, frames  # rows = positions
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "gpu" / "nvshmem_worker.py"), str(tiny_dir),
             str(tmp_path / "store"), cid, holder.address],
            env={**os.environ, **nv_env}, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        tail = proc.stdout[-3000:] + proc.stderr[-3000:] + log.read_text()[-3000:]
        assert proc.returncode == 0, tail
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"holder kernel {kernel}; worker: {json.dumps(out)}")
        assert out["routes"] == {"grpc": "grpc", "nvshmem": "nvshmem"}, out
        assert out["holder_errors"] == {"grpc": {}, "nvshmem": {}}, out
        assert out["tokens_equal"] and out["logits_equal"], out
        assert all(out["partials_equal"]), out
        assert out["bad_rows"] == {"grpc": "OUT_OF_RANGE", "nvshmem": "OUT_OF_RANGE"}, out
        assert out["metric_exported"], out
        # the holder outlives its NVSHMEM requester
        assert asyncio.run(assign())[0] == frames
    finally:
        t0 = time.monotonic()
        try:
            code = holder.stop(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            code = None
        stopped_s = time.monotonic() - t0
    text = log.read_text()
    print(f"holder drained in {stopped_s:.1f} s, exit {code}")
    assert "offering NVSHMEM job" in text and "joins as rank 1" in text, text[-3000:]
    assert code == 0, text[-3000:]
