"""The SGLang plugin's device path on a GPU (``pytest -m sglang``), against the torch reference:
SGLang's fp8 indexer kernel over the arena, FlashMLA's sparse partial over bf16 pools and its fp8
sparse decode over pools of fp8 rows, a holder's pool (either format) mapped by CUDA IPC from a
real holder process, and the whole layer step captured in a CUDA graph and replayed after the
request tables change. Skipped elsewhere with the reason."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.kernels import fp8_cache as f8
from corpusd.kernels.reference import partial_attention
from corpusd.model import ModelConfig, fingerprint
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.numeric import rel
from corpusd.testing.resident import SEED, random_resident
from requester.sglang import device, device_scores
from requester.sglang.lse import merge_local_corpus
from requester.sglang.resident import ArenaCorpus, Resident, index_pages
from tests.support.checks import why_no_sglang_gpu
from tests.support.graphs import capture

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(bool(why_no_sglang_gpu()), reason=why_no_sglang_gpu()),
]


@pytest.mark.parametrize("n", [8, device_scores.SCORE_ROWS + 37], ids=["one-call", "chunked"])
def test_corpus_scores_are_the_reference_through_sglangs_fp8_kernel(n: int) -> None:
    """8 rows: one DeepGEMM call; SCORE_ROWS + 37 rows: two calls of SCORE_ROWS rows each, the
    second padded (the row count a prefill gives)."""
    res, (a, b) = random_resident([3000, 700])
    g = torch.Generator(device="cuda").manual_seed(SEED)
    h = 64
    q = torch.randn(n, h, 128, generator=g, device="cuda").to(torch.float8_e4m3fn)
    w = torch.rand(n, h, generator=g, device="cuda")
    base = torch.tensor([a.base_page, b.base_page, 0] * n, dtype=torch.int32).cuda()[:n]
    tokens = torch.tensor([a.tokens, b.tokens, 0] * n, dtype=torch.int32).cuda()[:n]
    got = device_scores.corpus_scores(res, 0, q, w, base, tokens)
    assert got.shape[0] == n
    want = device_scores.paged_scores_reference(q, w, res.pages[0], res.block_table(base), 64)
    for i in range(n):
        t = int(tokens[i])
        if t:
            # deep_gemm sums in another order (and may fold the scale in differently)
            assert rel(got[i, :t], want[i, :t]) < 2e-4, f"row {i}"


def _compiled(kernel: object) -> int:
    """How many variants Triton has compiled of ``kernel`` (its per-device caches)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in kernel.cache.values())  # type: ignore[attr-defined,misc]


def test_prefills_of_new_sizes_compile_nothing_after_warm_up() -> None:
    """The defect: DeepGEMM's schedule kernel is JIT-compiled per row count rounded up to 32
    (~0.9 s each), and prefills come in every size; every new one stalled SGLang's scheduler
    (route's first token under a 64-stream burst: 4.7 s). After ``warm_up`` neither it nor the
    fused top-k's Triton kernels compile for prefills of sizes never seen."""
    import time

    from requester.sglang import device_triton

    res, (a, _) = random_resident([3000, 700])
    assert device_scores.warm_up(res, torch.device("cuda"), 2048)
    before = _compiled(device_triton._keys_kernel)
    g = torch.Generator(device="cuda").manual_seed(SEED)
    for n, width in ((601, 48), (1303, 49), (77, 50)):  # row counts no call has used
        q = torch.randn(n, 64, 128, generator=g, device="cuda").to(torch.float8_e4m3fn)
        w = torch.rand(n, 64, generator=g, device="cuda")
        base = torch.full((n,), a.base_page, dtype=torch.int32, device="cuda")
        tokens = torch.full((n,), a.tokens, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        scores = device_scores.corpus_scores(res, 0, q, w, base, tokens)
        own = torch.randn(n, width, generator=g, device="cuda")
        own_len = torch.full((n,), width, dtype=torch.int64, device="cuda")  # as SGLang's
        device.fused_topk(scores, tokens, own, own_len, 2048)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        assert took < 0.3, f"{n} rows took {took:.2f} s: a kernel compiled for the new size"
    assert _compiled(device_triton._keys_kernel) == before


@pytest.mark.parametrize("splits", [None, 1], ids=["auto-triton", "flashmla"])
def test_sparse_partial_matches_the_reference(splits: int | None) -> None:
    """At 6 rows the default is the Triton flash-decoding kernel; ``splits=1`` forces
    FlashMLA's sparse kernel."""
    g = torch.Generator(device="cuda").manual_seed(SEED)
    n, h, rows, k = 6, 64, 4096, 2048
    q = torch.randn(n, h, 576, generator=g, device="cuda").bfloat16()
    kv = torch.randn(rows, 576, generator=g, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(rows, generator=g, device="cuda")[:k] for _ in range(n)])
    idx = idx.int()
    idx[1, 100:] = -1
    idx[2] = -1
    from corpusd.kernels.flashmla import sparse_lse_base2

    base2 = sparse_lse_base2("cuda")
    o, lse = device.sparse_partial(q, kv, idx, 576**-0.5, 512, base2, splits)
    ro, rl = partial_attention(q.float(), kv.float(), idx.long(), 576**-0.5, 512)
    fin = torch.isfinite(rl)
    assert rel(o, ro) < 1e-2 and rel(lse[fin], rl[fin]) < 1e-3
    assert bool(torch.isinf(lse[2]).all()) and bool((o[2] == 0).all())


def _canon(res: Resident, c: ArenaCorpus, layer: int = 0) -> torch.Tensor:
    """Corpus ``c``'s pool rows laid out by position: page p is its frame of its holder's pool."""
    span = slice(c.base_page, c.base_page + c.n_pages)
    where = zip(res.page_holder[span].tolist(), res.page_frame[span].tolist(), strict=True)
    return torch.cat([res.pools[s][layer][f * 64 : (f + 1) * 64] for s, f in where])


def test_fp8_corpus_partial_is_flashmlas_fp8_decode_and_matches_the_reference() -> None:
    """Three holders' fp8 pools: each row's corpus partial through FlashMLA's fp8 sparse decode
    (one call per pool, merged by LSE) against ``fp8_partial_attention`` over the corpus's rows
    in position order; O within 1e-2 relative, LSE within 1e-2, empty rows exact."""
    from corpusd.kernels import flashmla

    res, (a, b) = random_resident([3000, 700], pools=3, fp8=True)
    assert res.kv_format == "fp8_e4m3" and res.pools[0][0].dtype == torch.uint8
    assert flashmla.lse_to_natural("cuda:0", fp8=True) in (1.0, math.log(2.0))
    g = torch.Generator(device="cuda").manual_seed(SEED)
    n, h, k = 9, 64, 2048
    bound = [a, b, None] * 3
    q = torch.randn(n, h, 576, generator=g, device="cuda").bfloat16()
    pos = torch.full((n, k), -1, dtype=torch.int64, device="cuda")
    for i, c in enumerate(bound):
        if c is not None:
            take = min(k, c.tokens)
            pos[i, :take] = torch.randperm(c.tokens, generator=g, device="cuda")[:take]
    pos[3, 100:] = -1  # a row that selected few
    base = torch.tensor([c.base_page if c else 0 for c in bound], dtype=torch.int32).cuda()
    scale = 576**-0.5
    o, lse = device.corpus_partial(res, 0, q, pos, base, scale, 512, base2=True)
    assert o.shape == (n, h, 512) and o.dtype == torch.float32 and lse.shape == (n, h)
    assert not o.isnan().any() and not lse.isnan().any()
    for i, c in enumerate(bound):
        if c is None:
            assert bool(torch.isneginf(lse[i]).all()) and bool((o[i] == 0).all()), f"row {i}"
            continue
        ro, rl = f8.fp8_partial_attention(
            q[i : i + 1].float().cpu(), _canon(res, c).cpu(), pos[i : i + 1].cpu(), scale, 512
        )
        err, lse_err = rel(o[i : i + 1].cpu(), ro), float((lse[i].cpu() - rl[0]).abs().max())
        assert err < 1e-2 and lse_err < 1e-2, f"row {i}: O rel {err:.2e}, |LSE err| {lse_err:.2e}"


def _layer_step(res: Resident, inp: dict[str, torch.Tensor], k: int) -> tuple[torch.Tensor, ...]:
    """One layer's corpus path as the backend runs it in decode."""
    base, tokens = res.rows_of(inp["slots"])
    scores = device_scores.corpus_scores(res, 0, inp["q_fp8"], inp["w"], base, tokens)
    corpus, own = device.fused_topk(scores, tokens, inp["own"], inp["own_len"], k)
    o_c, l_c = device.corpus_partial(res, 0, inp["q"], corpus, base, 576**-0.5, 512, True)
    o, lse = merge_local_corpus(inp["o_loc"], inp["lse_loc"], o_c, l_c)
    return corpus, own, o, lse


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n", [8, 24, 64])
def test_layer_step_in_a_cuda_graph_follows_the_tables_and_times_it(n: int, fp8: bool) -> None:
    """``n`` rows: SGLang's decode graphs above 16 requests crashed (issue 17); this captures the
    plugin's own part of a layer alone at those sizes, over bf16 pools (FlashMLA's sparse
    kernel) and fp8 pools (its fp8 sparse decode, scheduler metadata computed in the graph)."""
    from corpusd.kernels.flashmla import sparse_lse_base2

    assert sparse_lse_base2("cuda")  # the build these tests run on: base-2 LSE
    res, (a, b) = random_resident([3656, 1000], pools=1, fp8=fp8)
    if fp8:  # as the entry model does at start: the fp8 kernel's LSE base, never in a capture
        from corpusd.kernels import flashmla

        flashmla.lse_to_natural("cuda:0", fp8=True)
    g = torch.Generator(device="cuda").manual_seed(SEED)
    h, k, own_w = 64, 2048, 256
    slots = torch.arange(n, device="cuda") * 2 + 1  # request slots need not be 0..n-1
    res.bind(slots, ([a, b, None, a, a, b, a, None] * 8)[:n])
    inp = {
        "slots": slots,
        "q_fp8": torch.randn(n, 64, 128, generator=g, device="cuda").to(torch.float8_e4m3fn),
        "w": torch.rand(n, 64, generator=g, device="cuda"),
        "own": torch.randn(n, own_w, generator=g, device="cuda"),
        "own_len": torch.randint(1, own_w, (n,), generator=g, device="cuda"),
        "q": torch.randn(n, h, 576, generator=g, device="cuda").bfloat16(),
        "o_loc": torch.randn(n, h, 512, generator=g, device="cuda").bfloat16(),
        "lse_loc": torch.randn(n, h, generator=g, device="cuda"),
    }
    eager = _layer_step(res, inp, k)
    graph, _, out = capture(lambda: _layer_step(res, inp, k))
    graph.replay()
    for x, y in zip(out, eager, strict=True):
        assert torch.equal(x, y)
    # Rebind: slot 2 now reads corpus b, slot 0 is unbound; new queries. The graph follows.
    res.bind(slots[[0, 2]], [None, b])
    for key in ("q_fp8", "own", "q"):
        inp[key].copy_(torch.randn(inp[key].shape, generator=g, device="cuda").to(inp[key].dtype))
    graph.replay()
    again = _layer_step(res, inp, k)
    for x, y in zip(out, again, strict=True):
        assert torch.equal(x, y)
    assert bool((out[0][0] < 0).all()) and bool((out[0][2] >= 0).any())
    # Device-side timing of the graphed corpus path (no assertion: bench/results has the run).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(50):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    fmt = "fp8" if fp8 else "bf16"
    print(f"corpus path per layer, graphed, {n} rows, {fmt} pool: p50 {sorted(times)[25]:.0f} µs")


@pytest.mark.parametrize("kv_format", ["plain", "fp8_e4m3"])
def test_holder_pool_over_cuda_ipc_attends_as_the_holder(
    tmp_path: Path, tiny_dir: Path, kv_format: str
) -> None:
    """A real holder's pool (bf16 rows, or fp8 rows of an ``--kv-format fp8_e4m3`` pin) mapped
    by CUDA IPC: the device path's partial equals the holder's own answer to the same rows."""
    from corpusd.kernels import flashmla
    from corpusd.kernels.flashmla import sparse_lse_base2
    from requester.sglang.link import CorpusLink

    cid = pin_sample(tmp_path, tiny_dir, tokens=900, dtype="bfloat16", kv_format=kv_format)
    co = start_coordinator(tmp_path / "coord", tmp_path / "store")
    hp = start_holder(
        tmp_path / "store", tmp_path / "h0", tiny_dir, "--coordinator", co.address,
        "--device", "cuda:0", "--dtype", "bfloat16", "--capacity-tokens", "4096",
        "--kv-format", kv_format,
    )  # fmt: skip
    cfg = ModelConfig.from_dir(tiny_dir)
    link = CorpusLink(co.address, cfg, fingerprint(tiny_dir), 64)
    try:

        async def pin() -> None:
            async with CoordinatorClient(co.address) as c:
                await c.wait_holders(1)
                assert (await c.pin(cid)).corpus.state == "ready"

        asyncio.run(pin())
        res = Resident(
            n_layers=cfg.num_hidden_layers, page_size=64, index_dim=cfg.index_head_dim,
            arena_tokens=4096, window_tokens=1024, device="cuda:0", ue8m0=False, req_slots=8,
        )  # fmt: skip
        assert link.map_holders(res, torch.device("cuda:0")) == [hp.address]
        assert res.kv_format == kv_format
        assert len(res.incarnation[hp.address]) == 16  # the holder process's id (restarts)
        if kv_format == "fp8_e4m3":
            assert res.pools[0][0].dtype == torch.uint8 and res.pools[0][0].shape[1] == 656
            flashmla.lse_to_natural("cuda:0", fp8=True)
        bound = link.bind(cid)
        c = link.load_resident(bound, res)
        assert (c.tokens, c.n_pages) == (bound.tokens, math.ceil(bound.tokens / 64))
        t = c.tokens
        g = torch.Generator(device="cuda").manual_seed(SEED)
        n, h = 4, cfg.num_attention_heads
        q = torch.randn(n, h, cfg.kv_dim, generator=g, device="cuda").bfloat16()
        pos = torch.stack([torch.randperm(t, generator=g, device="cuda")[:128] for _ in range(n)])
        pos[3, 60:] = -1
        base = torch.full((n,), c.base_page, dtype=torch.int32, device="cuda")
        scale = cfg.kv_dim**-0.5
        for layer in range(cfg.num_hidden_layers):
            o, lse = device.corpus_partial(
                res, layer, q, pos, base, scale, cfg.kv_lora_rank, sparse_lse_base2("cuda")
            )
            want_o, want_l = link.attend(bound, layer, q.float().cpu(), pos.cpu(), scale)
            assert rel(o.cpu(), want_o) < 2e-2 and rel(lse.cpu(), want_l) < 1e-3, f"{layer=}"
            # The arena's pages are the index keys the holder serves, in SGLang's format.
            keys = link.catalog.run(link.catalog._index_keys(cid, layer))
            assert torch.equal(res.pages[layer][: c.n_pages].cpu(), index_pages(keys, 64, False))
    finally:
        link.close()
        hp.stop()
        co.stop()


def test_one_call_is_flashmla_over_own_and_corpus_rows_in_sglangs_layout_in_a_graph() -> None:
    """``device.one_call_partial`` on the GPU (CORPUSD_SGLANG_ONE_CALL): the Triton copy (corpus
    rows re-interleaved into SGLang's layout, own rows as they are, 4 query rows a copy) and
    one FlashMLA call, captured in a graph, against the exact attention over both sides."""
    from corpusd.kernels.flashmla import sparse_lse_base2
    from requester.sglang.positions import to_sglang_layout

    res, (a,) = random_resident([3000], pools=2)
    res.stage_rows = 4
    g = torch.Generator(device="cuda").manual_seed(SEED)
    m, n, h, k, t = 8, 6, 64, 2048, a.tokens
    own_kv = torch.randn(700, 1, 576, generator=g, device="cuda").bfloat16()
    is_own = torch.rand(m, k, generator=g, device="cuda") < 0.1
    own_rows = torch.where(is_own, torch.randint(0, 700, (m, k), generator=g, device="cuda"), -1)
    own_rows = own_rows.to(torch.int32)
    pos = torch.stack([torch.randperm(t, generator=g, device="cuda")[:k] for _ in range(n)])
    pos = torch.where(is_own[:n], -1, pos)
    base = torch.full((n,), a.base_page, dtype=torch.int32, device="cuda")
    q = torch.randn(m, h, 576, generator=g, device="cuda").bfloat16()
    scale, base2 = 576**-0.5, sparse_lse_base2("cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return device.one_call_partial(res, 0, q, own_kv, own_rows, pos, base, scale, 512, base2)

    eager = step()
    graph, _, out = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    # the corpus laid out canonically from the pools, in SGLang's layout, then the own rows
    pages = range(a.base_page, a.base_page + a.n_pages)
    frame = [int(res.page_frame[p]) * 64 for p in pages]
    canon = torch.cat([res.pools[int(res.page_holder[p])][0][f : f + 64]
                       for p, f in zip(pages, frame, strict=True)])[:t]  # fmt: skip
    keys = torch.cat([to_sglang_layout(canon), own_kv[:, 0]]).float().cpu()
    full = torch.cat([pos, torch.full((m - n, k), -1, device="cuda")])
    where = torch.where(own_rows >= 0, t + own_rows.long(), full).cpu()
    want_o, want_l = partial_attention(q.float().cpu(), keys, where, scale, 512)
    assert rel(out[0].cpu(), want_o) < 2e-2 and rel(out[1].cpu(), want_l) < 1e-3
