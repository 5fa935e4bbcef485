"""A holder's pool on another GPU, mapped by the SGLang plugin's device path over peer access
(``cuda_p2p``), on a 2-GPU host (``-m gpu``; skipped with one GPU or no P2P between the two).

Real holder processes, one on each GPU, share a corpus's pages (their capacity splits it); the
device path on GPU 0 maps both (its own over CUDA IPC, GPU 1's over peer access) and its corpus
partial, eager and captured in a CUDA graph, equals what the holders answer over gRPC for the
same rows. Then GPU 1's holder is SIGKILLed and the graph reads its still-mapped pool: the
mapping holds the memory (``RETAINED`` in :mod:`requester.fanout_device`). The graphed partial's
device time per layer, peer against own GPU, is printed (the bench's figure, not asserted)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.model import ModelConfig, fingerprint
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.numeric import rel
from corpusd.testing.resident import SEED
from tests.support.graphs import capture


def _why_not() -> str:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs"
    if not torch.cuda.can_device_access_peer(0, 1):
        return "GPU 0 has no peer access to GPU 1"
    return ""


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_why_not()), reason=_why_not())]


def _time_us(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


@pytest.mark.parametrize("stage_rows", [0, 3], ids=["in-place", "staged"])
def test_a_pool_on_the_other_gpu_is_read_over_peer_access_inside_a_graph(
    tmp_path: Path, tiny_dir: Path, stage_rows: int
) -> None:
    """Read in place (``CORPUSD_SGLANG_STAGE_ROWS=0``) or staged, 3 query rows a copy (8 rows:
    three copies, the last short): the same answers as the holders' gRPC, eager and graphed."""
    from corpusd.kernels.flashmla import sparse_lse_base2
    from requester.sglang import device
    from requester.sglang.link import CorpusLink
    from requester.sglang.resident import Resident

    tokens = 1800  # 29 pages; 16 frames a holder: the pin spreads it over both
    cid = pin_sample(tmp_path, tiny_dir, tokens=tokens, dtype="bfloat16")
    co = start_coordinator(tmp_path / "coord", tmp_path / "store")
    holders = [
        start_holder(
            tmp_path / "store",
            tmp_path / f"h{i}",
            tiny_dir,
            "--coordinator",
            co.address,
            "--device",
            f"cuda:{i}",
            "--dtype",
            "bfloat16",
            "--capacity-tokens",
            "1024",
        )
        for i in range(2)
    ]
    cfg = ModelConfig.from_dir(tiny_dir)
    link = CorpusLink(co.address, cfg, fingerprint(tiny_dir), 64)
    try:

        async def pin() -> None:
            async with CoordinatorClient(co.address) as c:
                await c.wait_holders(2)
                assert (await c.pin(cid)).corpus.state == "ready"

        asyncio.run(pin())
        res = Resident(
            n_layers=cfg.num_hidden_layers, page_size=64, index_dim=cfg.index_head_dim,
            arena_tokens=4096, window_tokens=2048, device="cuda:0", ue8m0=False, req_slots=8,
            stage_rows=stage_rows,
        )  # fmt: skip
        own, peer = holders[0].address, holders[1].address
        assert sorted(link.map_holders(res, torch.device("cuda:0"))) == sorted([own, peer])
        assert res.transport == {own: "cuda_ipc", peer: "cuda_p2p"}
        assert res.staged == (stage_rows > 0)
        assert all(t.device == torch.device("cuda:0") for t in res.pools[res.holder_slot[peer]])
        bound = link.bind(cid)
        c = link.load_resident(bound, res)
        held = {a for a, _ in c.placement}
        assert held == {own, peer}, f"the pin did not spread the corpus: {held}"
        assert c.plan is not None
        assert {g.transport for g in c.plan.groups} == {"cuda_ipc", "cuda_p2p"}
        t = c.tokens
        g = torch.Generator(device="cuda").manual_seed(SEED)
        n, h = 8, cfg.num_attention_heads
        q = torch.randn(n, h, cfg.kv_dim, generator=g, device="cuda").bfloat16()
        pos = torch.stack([torch.randperm(t, generator=g, device="cuda")[:1024] for _ in range(n)])
        pos[3, 600:] = -1
        base = torch.full((n,), c.base_page, dtype=torch.int32, device="cuda")
        scale = cfg.kv_dim**-0.5
        base2 = sparse_lse_base2("cuda")
        want = []
        for layer in range(cfg.num_hidden_layers):
            o, lse = device.corpus_partial(res, layer, q, pos, base, scale, cfg.kv_lora_rank, base2)
            want_o, want_l = link.attend(bound, layer, q.float().cpu(), pos.cpu(), scale)
            assert rel(o.cpu(), want_o) < 2e-2 and rel(lse.cpu(), want_l) < 1e-3, f"{layer=}"
            want.append((want_o, want_l))

        def step() -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [
                device.corpus_partial(res, layer, q, pos, base, scale, cfg.kv_lora_rank, base2)
                for layer in range(cfg.num_hidden_layers)
            ]

        graph, eager, out = capture(step)
        graph.replay()
        torch.cuda.synchronize()
        for (o, lse), (eo, el) in zip(out, eager, strict=True):
            assert torch.equal(o, eo) and torch.equal(lse, el)
        split_us = _time_us(graph) / cfg.num_hidden_layers
        # the peer's pool alone, graphed: every selected row read across the link
        peer_slot = res.holder_slot[peer]
        only = torch.where(res.page_holder == peer_slot, res.page_holder, -1)
        res.page_holder.copy_(only)  # the own GPU's pages read as unused: peer rows only

        graph.replay()
        torch.cuda.synchronize()
        peer_us = _time_us(graph) / cfg.num_hidden_layers
        how = "staged" if stage_rows else "in place"
        print(f"\ncorpus path per layer ({how}), graphed, {n} rows × {pos.shape[1]}, bf16 pool: "
              f"split over own + peer GPU {split_us:.0f} µs, peer GPU's pages only "
              f"{peer_us:.0f} µs")  # fmt: skip
        before = [(o.clone(), lse.clone()) for o, lse in out]
        # SIGKILL the peer GPU's holder: its pool stays mapped, the graph reads the same rows
        holders[1].kill()
        graph.replay()
        torch.cuda.synchronize()
        for (o, lse), (bo, bl) in zip(out, before, strict=True):
            assert torch.equal(o, bo) and torch.equal(lse, bl)
        assert not math.isnan(float(out[0][0].float().sum()))
    finally:
        link.close()
        for hp in holders:
            hp.kill()
        co.stop()
