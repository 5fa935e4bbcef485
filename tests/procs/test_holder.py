"""Real holder processes on loopback: route, fetch, indexer, restart, bad input, metrics."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from corpusd.corpus.store import PageStore
from corpusd.kernels.merge import merge_partials
from corpusd.kernels.reference import partial_attention
from corpusd.model import ModelConfig
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.numeric import rel
from corpusd.v1 import holder_pb2, tensor_pb2
from holder.launch import HolderProcess
from indexer import index_scores, select_topk
from requester.holder_client import HolderClient

SCALE = 0.05


@pytest.fixture(scope="module")
def tiny_dir(sglang_dir: Path) -> Path:
    """This module sizes its corpora in byte tokens and needs V3.2's 64 × 128 indexer (fp8 index
    arithmetic quantizes 128-wide keys): the sglang preset, not the CPU default."""
    return sglang_dir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("holder-corpus")
    return tmp / "store", pin_sample(tmp, tiny_dir, tokens=1000)  # 16 pages, last one partial


@pytest.fixture(scope="module")
def holders(
    tmp_path_factory: pytest.TempPathFactory, corpus: tuple[Path, str], tiny_dir: Path
) -> Iterator[list[HolderProcess]]:
    store, _ = corpus
    tmp = tmp_path_factory.mktemp("holders")
    procs = [
        start_holder(store, tmp / f"h{i}", tiny_dir, "--capacity-tokens", "2048") for i in range(4)
    ]
    yield procs
    codes = [p.stop() for p in procs]
    assert codes == [0] * len(procs), f"holders did not drain cleanly: {codes}"


def _corpus_latent(store: Path, cid: str, layer: int) -> torch.Tensor:
    ps = PageStore(store)
    m = ps.manifest(cid)
    lat, _ = ps.read_pages(cid, layer, list(range(m.n_pages)))
    return lat.reshape(-1, m.kv_dim)[: m.token_count]


def _pool_rows(positions: torch.Tensor, frames: dict[int, int], page: int = 64) -> torch.Tensor:
    """Corpus positions → pool rows through a page→frame map; -1 stays -1 (and so do positions
    whose page is not in ``frames``)."""
    out = torch.full_like(positions, -1)
    for idx, pos in enumerate(positions.view(-1).tolist()):
        if pos >= 0 and pos // page in frames:
            out.view(-1)[idx] = frames[pos // page] * page + pos % page
    return out


def _queries(seed: int, n: int, t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 64, 576, generator=g)
    pos = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(n)])
    pos[0, k // 2 :] = -1  # a padded row
    return q, pos


def test_attend_equals_the_reference_partial(
    holders: list[HolderProcess], corpus: tuple[Path, str]
) -> None:
    store, cid = corpus
    latent = _corpus_latent(store, cid, 1)

    async def go() -> None:
        c = HolderClient(holders[0].address)
        frames = await c.assign(cid)
        q, pos = _queries(1, 5, latent.shape[0], 48)
        got = await c.attend_rows(cid, 1, q, _pool_rows(pos, frames), SCALE)
        ref_o, ref_lse = partial_attention(q, latent, pos, SCALE, 512)
        assert got.kernel == "torch" and got.o.shape == (5, 64, 512)
        assert rel(got.o, ref_o) <= 1e-6 and rel(got.lse, ref_lse) <= 1e-6
        await c.close()

    asyncio.run(go())


@pytest.mark.parametrize("n_holders", [2, 3, 4])
def test_partials_from_holders_merge_to_the_monolithic_partial(
    holders: list[HolderProcess], corpus: tuple[Path, str], n_holders: int
) -> None:
    store, cid = corpus
    m = PageStore(store).manifest(cid)
    latent = _corpus_latent(store, cid, 0)
    rng = random.Random(n_holders)
    owner = {p: rng.randrange(n_holders) for p in range(m.n_pages)}  # random page partition

    async def go() -> None:
        clients = [HolderClient(h.address) for h in holders[:n_holders]]
        for c in clients:
            await c.release(cid) if cid in [x.corpus_id for x in (await c.info()).corpora] else None
        frames = await asyncio.gather(
            *(
                c.assign(cid, [p for p, o in owner.items() if o == i])
                if any(o == i for o in owner.values())
                else asyncio.sleep(0, result={})
                for i, c in enumerate(clients)
            )
        )
        q, pos = _queries(10 + n_holders, 7, m.token_count, 96)
        parts = await asyncio.gather(
            *(
                c.attend_rows(cid, 0, q, _pool_rows(pos, fr), SCALE)
                for c, fr in zip(clients, frames, strict=True)
                if fr
            )
        )
        o, lse = merge_partials([(p.o, p.lse) for p in parts])
        ref_o, ref_lse = partial_attention(q, latent, pos, SCALE, 512)
        assert rel(o, ref_o) <= 1e-5 and rel(lse, ref_lse) <= 1e-5
        for c in clients:
            await c.release(cid)
            await c.close()

    asyncio.run(go())


def test_fetch_returns_the_exact_pinned_bytes(
    holders: list[HolderProcess], corpus: tuple[Path, str]
) -> None:
    store, cid = corpus
    ps = PageStore(store)

    async def go() -> None:
        c = HolderClient(holders[1].address)
        await c.assign(cid)
        pages = [15, 0, 7]
        lat, idx = await c.fetch(cid, pages, index_keys=True)
        for layer in range(2):
            ref_lat, ref_idx = ps.read_pages(cid, layer, pages)
            assert torch.equal(lat[layer], ref_lat) and torch.equal(idx[layer], ref_idx)
        keys = await c.index_keys(cid, 1)
        _, all_idx = ps.read_pages(cid, 1, sorted(keys))
        assert torch.equal(torch.stack([keys[p] for p in sorted(keys)]), all_idx)
        await c.release(cid)
        await c.close()

    asyncio.run(go())


@pytest.mark.parametrize("arith", ["exact", "fp8"])
def test_distributed_index_topk_merges_to_the_exact_global_topk(
    holders: list[HolderProcess], corpus: tuple[Path, str], arith: str
) -> None:
    store, cid = corpus
    ps = PageStore(store)
    m = ps.manifest(cid)
    _, keys = ps.read_pages(cid, 1, list(range(m.n_pages)))
    keys = keys.reshape(-1, m.index_dim)[: m.token_count]
    g = torch.Generator().manual_seed(3)
    q, w = torch.randn(4, 64, 128, generator=g), torch.randn(4, 64, generator=g)
    limit = torch.tensor([1000, 900, 200, 1000])
    k = 128

    async def go() -> None:
        clients = [HolderClient(h.address) for h in holders[:2]]
        await clients[0].assign(cid, list(range(0, 16, 2)))
        await clients[1].assign(cid, list(range(1, 16, 2)))
        local = await asyncio.gather(
            *(c.index_topk(cid, 1, q, w, limit, k, arith) for c in clients)
        )
        pos = torch.cat([p for p, _ in local], dim=1)
        sc = torch.cat([s for _, s in local], dim=1)
        # Merge: top-k of the union by (score desc, position asc).
        full = torch.full((4, m.token_count), float("-inf"))
        for r in range(4):
            ok = pos[r] >= 0
            full[r, pos[r][ok]] = sc[r][ok]
        merged = select_topk(full, k, limit)
        ref = select_topk(index_scores(q, w, keys, 128**-0.5, arith), k, limit)
        assert torch.equal(merged, ref)
        if arith == "fp8":  # the holders did not score exactly: fp8 rounding moved the cut
            exact = select_topk(index_scores(q, w, keys, 128**-0.5), k, limit)
            assert not torch.equal(merged, exact)
        for c in clients:
            await c.release(cid)
            await c.close()

    asyncio.run(go())


async def _status(coro) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _tensor(
    dtype: str, shape: list[int], data: bytes | None = None, fill: float = 0.0
) -> tensor_pb2.Tensor:
    t = torch.full(shape, fill, dtype=getattr(torch, dtype))
    msg = tensor_pb2.Tensor(
        dtype=dtype, shape=shape, data=t.view(-1).view(torch.uint8).numpy().tobytes()
    )
    if data is not None:
        msg.data = data
    return msg


def test_bad_input_gets_a_status_and_the_holder_keeps_serving(
    holders: list[HolderProcess], corpus: tuple[Path, str]
) -> None:
    _, cid = corpus
    S = grpc.StatusCode

    def req(**kw: object) -> holder_pb2.AttendRequest:
        base: dict[str, object] = {
            "corpus_id": cid,
            "layer": 0,
            "q": _tensor("float32", [2, 64, 576]),
            "rows": _tensor("int32", [2, 8]),
            "scale": SCALE,
        }
        base.update(kw)
        return holder_pb2.AttendRequest(**base)  # type: ignore[arg-type]

    cases = [
        (req(corpus_id="nope"), S.NOT_FOUND, "not held"),
        (req(layer=9), S.OUT_OF_RANGE, "layer 9 out of range"),
        (req(q=_tensor("float32", [2, 64, 100])), S.INVALID_ARGUMENT, "q must be"),
        (req(q=_tensor("int64", [2, 64, 576])), S.INVALID_ARGUMENT, "dtype 'int64' not accepted"),
        (
            req(q=_tensor("float32", [2, 64, 576], data=b"\0" * 10)),
            S.INVALID_ARGUMENT,
            "data bytes",
        ),
        (req(q=_tensor("float32", [2, 64, 576], fill=float("nan"))), S.INVALID_ARGUMENT, "NaN"),
        (req(rows=_tensor("int32", [3, 8])), S.INVALID_ARGUMENT, "rows must be"),
        (req(rows=_tensor("int32", [2, 8], fill=10**6)), S.OUT_OF_RANGE, "outside the pool"),
        (
            req(rows=_tensor("int32", [2, 8], fill=64 * 20)),
            S.OUT_OF_RANGE,
            "not in a frame of corpus",
        ),
        (req(rows=_tensor("int32", [2, 8], fill=-5)), S.OUT_OF_RANGE, "below -1"),
        (req(scale=float("inf")), S.INVALID_ARGUMENT, "scale"),
        (req(q=_tensor("float32", [8193, 1, 576])), S.INVALID_ARGUMENT, "q must be"),
        (req(q=_tensor("float32", [1, 1025, 576])), S.INVALID_ARGUMENT, "1 ≤ h ≤ 1024"),
    ]

    async def go() -> None:
        c = HolderClient(holders[2].address, max_message_bytes=512 << 20)
        frames = await c.assign(cid)
        for request, code, msg in cases:
            got = await _status(c.stub.Attend(request))
            assert got[0] == code and msg in got[1], (request.corpus_id, got)
        # past the holder's transport limit (256 MiB + 1 MiB): gRPC itself refuses it
        huge = req(q=_tensor("float32", [40000, 2, 576]))
        huge.q.data = b"\0" * (300 << 20)
        assert (await _status(c.stub.Attend(huge)))[0] == S.RESOURCE_EXHAUSTED
        assert (await _status(c.fetch(cid, [99])))[0] == S.OUT_OF_RANGE
        assert (await _status(c.fetch(cid, [0], layers=[5])))[0] == S.OUT_OF_RANGE
        assert (await _status(c.assign("0" * 32)))[0] == S.NOT_FOUND
        assert (await _status(c.assign(cid, [500])))[0] == S.OUT_OF_RANGE
        bad_topk = c.index_topk(
            cid, 0, torch.zeros(2, 64, 128), torch.zeros(3, 64), torch.ones(2), 8
        )
        assert (await _status(bad_topk))[0] == S.INVALID_ARGUMENT
        bad_arith = c.index_topk(
            cid, 0, torch.zeros(2, 64, 128), torch.zeros(2, 64), torch.ones(2), 8, "fp4"
        )
        code, msg = await _status(bad_arith)
        assert code == S.INVALID_ARGUMENT and "arith 'fp4'" in msg, msg
        # ... and a good request still works
        q, pos = _queries(5, 2, 1000, 16)
        good = await c.attend_rows(cid, 0, q, _pool_rows(pos, frames), SCALE)
        assert torch.isfinite(good.lse[1]).all()
        # past FlashMLA's 128 heads a call (a 160-head model): served, each head as alone
        wide = await c.attend_rows(cid, 0, q.repeat(1, 3, 1)[:, :160], _pool_rows(pos, frames),
                                   SCALE)  # fmt: skip
        assert wide.o.shape[1] == 160 and torch.isfinite(wide.lse).all()
        for i in (0, 64, 128):  # heads i… repeat q's
            h = min(64, 160 - i)
            torch.testing.assert_close(
                wide.lse[:, i : i + h], good.lse[:, :h], rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(wide.o[:, i : i + h], good.o[:, :h], rtol=1e-5, atol=1e-5)
        health = health_pb2_grpc.HealthStub(c.channel)
        r = await health.Check(health_pb2.HealthCheckRequest(service="corpusd.v1.Holder"))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        await c.release(cid)
        await c.close()

    asyncio.run(go())


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_show_the_counters_moving(
    holders: list[HolderProcess], corpus: tuple[Path, str]
) -> None:
    _, cid = corpus
    h = holders[3]
    ok = ("corpusd_holder_requests_total", (("code", "OK"), ("method", "Attend")))
    before = _metrics(h.metrics_port)

    async def go() -> None:
        c = HolderClient(h.address)
        frames = await c.assign(cid, [0, 1, 2])
        q, pos = _queries(9, 4, 192, 32)
        for _ in range(3):
            await c.attend_rows(cid, 0, q, _pool_rows(pos, frames), SCALE)
        await _status(c.attend_rows("nope", 0, q, pos, SCALE))
        await c.close()

    asyncio.run(go())
    after = _metrics(h.metrics_port)
    assert after[ok] - before.get(ok, 0) == 3
    assert (
        after[("corpusd_holder_requests_total", (("code", "NOT_FOUND"), ("method", "Attend")))] >= 1
    )
    assert after[("corpusd_holder_pages_resident", ())] == 3
    assert after[("corpusd_holder_partial_seconds_count", (("k", "128"), ("rows", "4")))] >= 3
    assert after[("corpusd_holder_bytes_in_total", (("method", "Attend"),))] > 3 * 4 * 64 * 576 * 4
    assert after[("corpusd_holder_kernel_info", (("device", "cpu"), ("kernel", "torch")))] == 1


def test_restart_reloads_the_same_frames(
    tmp_path: Path, corpus: tuple[Path, str], tiny_dir: Path
) -> None:
    store, cid = corpus
    q, pos = _queries(4, 3, 1000, 40)

    async def first(addr: str) -> tuple[dict[int, int], torch.Tensor]:
        c = HolderClient(addr)
        assert (await c.info()).capacity_frames == 20
        await c.assign(cid, [3, 9, 1])
        frames = await c.assign(cid, [5, 15, 0])
        frames.update(await c.assign(cid, [3, 9, 1]))
        await c.release(cid, [9])
        del frames[9]
        out = await c.attend_rows(cid, 1, q, _pool_rows(pos, frames), SCALE)
        await c.close()
        return frames, out.o

    async def second(addr: str, frames: dict[int, int]) -> torch.Tensor:
        c = HolderClient(addr)
        info = await c.info()
        held = {pf.page: pf.frame for pf in info.corpora[0].frames}
        assert held == frames and info.used_frames == len(frames)
        out = await c.attend_rows(cid, 1, q, _pool_rows(pos, frames), SCALE)
        await c.close()
        return out.o

    # sized by bytes: 20 frames of (layers × 64 rows × (latent + index key) fp32 values)
    mc = ModelConfig.from_dir(tiny_dir)
    row = mc.kv_lora_rank + mc.qk_rope_head_dim + mc.index_head_dim
    size = ["--capacity-bytes", str(20 * mc.num_hidden_layers * 64 * row * 4)]
    h = start_holder(store, tmp_path / "h", tiny_dir, *size)
    frames, o1 = asyncio.run(first(h.address))
    assert h.stop() == 0
    named = (tmp_path / "h" / "holder_id").read_text().strip()
    # a name, not its first port (issue 19: status showed holder-35333 at :46701 after a restart)
    assert h.address.rsplit(":", 1)[1] not in named, named
    h = start_holder(store, tmp_path / "h", tiny_dir, *size)
    try:
        assert torch.equal(asyncio.run(second(h.address, frames)), o1)
        assert (tmp_path / "h" / "holder_id").read_text().strip() == named
    finally:
        assert h.stop() == 0


def test_overload_answers_resource_exhausted_and_keeps_serving(
    tmp_path: Path, corpus: tuple[Path, str], tiny_dir: Path
) -> None:
    store, cid = corpus
    h = start_holder(
        store,
        tmp_path / "h",
        tiny_dir,
        "--max-flows",
        "1",
        "--max-queue",
        "1",
        "--queue-timeout-s",
        "0.05",
    )
    q, pos = _queries(6, 256, 1000, 256)

    async def go() -> list[grpc.StatusCode]:
        c = HolderClient(h.address)
        frames = await c.assign(cid)
        rows = _pool_rows(pos, frames)
        calls = (_status(c.attend_rows(cid, 0, q, rows, SCALE)) for _ in range(6))
        codes = await asyncio.gather(*calls)
        good = await c.attend_rows(cid, 0, q[:2], rows[:2], SCALE)
        assert good.o.shape == (2, 64, 512)
        await c.close()
        return [code for code, _ in codes]

    try:
        codes = asyncio.run(go())
    finally:
        assert h.stop() == 0
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
