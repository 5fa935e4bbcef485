"""Page integrity with real processes: a holder restarted over a corrupted page store refuses
the corrupt corpus, reports it and serves the others; Assign of a corrupt page answers DATA_LOSS
and changes nothing; a pin through the coordinator is then refused, with nothing kept."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.kernels.reference import partial_attention
from corpusd.testing.holders import start_holder, synthetic_corpus
from corpusd.testing.numeric import rel
from requester.holder_client import HolderClient
from tests.support.corrupt import flip_page

S = grpc.StatusCode
SCALE = 0.05


def _corrupt_metric(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.labels["when"], s.labels["what"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "corpusd_holder_corrupt_total"
    }


async def _code(coro) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    except CoordinatorError as e:
        return e.code, e.detail
    return S.OK, ""


def _rows(frames: dict[int, int], positions: torch.Tensor) -> torch.Tensor:
    return torch.tensor(
        [[frames[p // 64] * 64 + p % 64 for p in row] for row in positions.tolist()]
    )


def test_a_corrupt_page_is_refused_on_restart_and_on_assign_and_never_served(
    tmp_path: Path, tiny_dir: Path
) -> None:
    store = tmp_path / "store"
    bad, good = (synthetic_corpus(store, tiny_dir, 300, seed=s) for s in (1, 2))  # 5 pages each
    ps = PageStore(store)
    lat, _ = ps.read_pages(good, 1, list(range(5)))
    latent = lat.reshape(-1, lat.shape[-1])[:300]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, latent.shape[1], generator=g)
    pos = torch.stack([torch.randperm(300, generator=g)[:40] for _ in range(3)])

    async def first(addr: str) -> None:
        c = HolderClient(addr)
        await c.assign(bad)
        await c.assign(good)
        await c.close()

    h = start_holder(store, tmp_path / "h", tiny_dir)
    try:
        asyncio.run(first(h.address))
    finally:
        assert h.stop() == 0
    flip_page(store, bad, 1, 3)  # one byte of page 3's latent rows in layer 1

    async def second(addr: str, metrics_port: int) -> None:
        c = HolderClient(addr)
        info = await c.info()
        assert [x.corpus_id for x in info.corpora] == [good] and info.used_frames == 5
        assert _corrupt_metric(metrics_port) == {("restore", "page"): 1.0}
        code, msg = await _code(c.attend_rows(bad, 1, q, pos, SCALE))
        assert code == S.NOT_FOUND, (code, msg)  # never served: requesters fail over
        frames = {pf.page: pf.frame for pf in info.corpora[0].frames}
        out = await c.attend_rows(good, 1, q, _rows(frames, pos), SCALE)
        ref_o, ref_lse = partial_attention(q, latent, pos, SCALE, out.o.shape[-1])
        assert rel(out.o, ref_o) <= 1e-6 and rel(out.lse, ref_lse) <= 1e-6
        for pages in ([], [3], [2, 3, 4]):  # Assign with a page failing its digest
            code, msg = await _code(c.assign(bad, pages))
            assert code == S.DATA_LOSS and "pages [3]" in msg and "fail their digest" in msg, msg
        assert await c.info() == info  # nothing changed: frames, corpora, use
        assert _corrupt_metric(metrics_port) == {("restore", "page"): 1.0, ("assign", "page"): 3.0}
        assert sorted(await c.assign(bad, [0, 1, 2, 4])) == [0, 1, 2, 4]  # the intact pages load
        await c.close()

    h = start_holder(store, tmp_path / "h", tiny_dir)
    try:
        asyncio.run(second(h.address, h.metrics_port))
        text = (tmp_path / "h" / "holder.log").read_text()
        assert f"refused corpus {bad} on restore: corpus {bad}: 1 of 5 pages fail" in text, text
    finally:
        assert h.stop() == 0

    async def pin(coordinator: str, holder: str) -> None:
        async with CoordinatorClient(coordinator) as cc:
            await cc.wait_holders(1)
            code, msg = await _code(cc.pin(bad))
            assert code == S.DATA_LOSS and "was not published (nothing kept)" in msg, msg
            assert [x.corpus_id for x in await cc.list_corpora()] == []
            assert (await cc.pin(good)).corpus.state == "ready"
        c = HolderClient(holder)
        assert [x.corpus_id for x in (await c.info()).corpora] == [good]
        await c.close()

    co = start_coordinator(tmp_path / "coord", store)
    h = start_holder(store, tmp_path / "h2", tiny_dir, "--coordinator", co.address)
    try:
        asyncio.run(pin(co.address, h.address))
    finally:
        assert h.stop() == 0
        assert co.stop() == 0
