"""CUDA-graph buckets and the K-stream staging pool (``-m gpu``; skip without CUDA)."""

from __future__ import annotations

import pytest
import torch

from corpusd.kernels.merge import merge_partials

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
D, D_V = 576, 512


def test_graph_buckets_replay_equals_eager_for_every_row_count() -> None:
    from corpusd.cuda_graphs import GraphBuckets, InputSpec
    from corpusd.kernels.registry import REGISTRY

    fn = REGISTRY["triton"].fn
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % (1 << 31))
    pool = torch.randn(4096, D, generator=g, device="cuda").bfloat16()
    h, k = 16, 256
    buckets = GraphBuckets(
        lambda q, i: fn(q, pool, i, D**-0.5, D_V),
        [InputSpec((h, D), torch.bfloat16, 0.0), InputSpec((k,), torch.int32, -1)],
        "cuda",
        buckets=(1, 4, 16),
    )
    assert [buckets.bucket(n) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="exceed"):
        buckets.bucket(17)
    for n in (1, 3, 4, 9, 16):  # exact buckets and padded ones; the order reuses the pool
        q = torch.randn(n, h, D, generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, 4096, (n, k), generator=g, device="cuda", dtype=torch.int32)
        idx[0, : k // 2] = -1
        o, lse = buckets(q, idx)
        ref_o, ref_lse = fn(q, pool, idx, D**-0.5, D_V)
        assert o.shape == (n, h, D_V) and lse.shape == (n, h), f"{n=}"
        assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse), f"{n=}: replay ≠ eager"


def test_graphed_merge_pads_with_empty_partials() -> None:
    from corpusd.cuda_graphs import GraphBuckets, InputSpec

    h = 8
    specs = [
        InputSpec((h, D_V), torch.float32, 0.0),
        InputSpec((h,), torch.float32, float("-inf")),
    ] * 2
    mb = GraphBuckets(
        lambda o1, l1, o2, l2: merge_partials([(o1, l1), (o2, l2)]), specs, "cuda", (2, 8)
    )
    args = [torch.randn(5, h, D_V, device="cuda"), torch.randn(5, h, device="cuda")] * 2
    args[3] = torch.full((5, h), float("-inf"), device="cuda")  # the second partial is empty
    o, lse = mb(*args)
    assert torch.allclose(o, args[0]) and torch.allclose(lse, args[1])


def test_staging_pool_gathers_and_copies_on_its_streams() -> None:
    from holder.staging import StagingPool

    sp = StagingPool(3, "cuda")
    src = torch.randn(1000, D, device="cuda").bfloat16()
    for f in range(5):  # more flows than streams: round robin
        rows = torch.randint(0, 1000, (64,), device="cuda")
        dst = torch.empty(64, D, device="cuda", dtype=torch.bfloat16)
        host = torch.empty(64, D, dtype=torch.bfloat16, pin_memory=True)
        sp.gather(src, rows, dst, host).synchronize()
        assert torch.equal(host, src[rows].cpu()), f"flow {f}"
        out = torch.empty(64, D, dtype=torch.bfloat16, pin_memory=True)
        sp.copy([(dst, out)]).synchronize()
        assert torch.equal(out, host)


def test_shifted_positions_are_read_from_the_runners_buffer_at_replay() -> None:
    """SGLang's graph runner (one ForwardBatch for two warm-ups and the capture, graphs captured
    largest first into one shared pool): with ``shifted_positions`` every replay reads the
    runner's static positions buffer. Replacing ``forward_batch.positions`` without restoring it
    made the capture read the second warm-up's tensor, freed afterwards (issue 17)."""
    from types import SimpleNamespace

    from requester.sglang.positions import shifted_positions

    cos = torch.randn(4096, 8, device="cuda")  # the rope cache a position indexes
    shift = torch.full((64,), 1000, device="cuda", dtype=torch.int64)
    static = torch.zeros(64, dtype=torch.int64, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for bs in (64, 32, 16, 1):
        fb = SimpleNamespace(positions=static[:bs])

        def run_once(fb: SimpleNamespace = fb, bs: int = bs) -> torch.Tensor:
            pos = fb.positions
            with shifted_positions(fb, pos + shift[:bs]) as p:
                return cos[p.clamp(0, cos.shape[0] - 1)] * 2

        for _ in range(2):
            run_once()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = run_once()
        graphs[bs] = (g, out)
        del fb, run_once
    torch.cuda.empty_cache()
    junk = [torch.full((64,), 7777, device="cuda", dtype=torch.int64) for _ in range(64)]
    for bs, (g, out) in sorted(graphs.items()):
        static[:bs].copy_(torch.randint(0, 3000, (bs,), device="cuda"))
        g.replay()
        torch.testing.assert_close(out, cos[static[:bs] + 1000] * 2, rtol=0, atol=0)
    del junk
