"""A real coordinator and real holders on loopback: publish, queue, bad input, status, metrics."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.corpus.head import HEAD_TOKENS, corpus_head
from corpusd.corpus.store import PageStore
from corpusd.testing.holders import pin_sample, start_holders, synthetic_corpus
from corpusd.v1 import coordinator_pb2 as pb
from holder.launch import HolderProcess
from requester.holder_client import HolderClient

S = grpc.StatusCode


async def status_of(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except CoordinatorError as e:
        return e.code, e.detail
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return S.OK, ""


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> tuple[Path, list[str]]:
    """Three corpora in one store: 17, 10 and 15 pages of 64 tokens (the last one really pinned,
    from ``repo.tar`` beside the store)."""
    tmp = tmp_path_factory.mktemp("coord-corpora")
    store = tmp / "store"
    big, small = (synthetic_corpus(store, tiny_dir, t, seed=t) for t in (1050, 600))
    return store, [big, small, pin_sample(tmp, tiny_dir, tokens=900)]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    corpora: tuple[Path, list[str]],
    tiny_dir: Path,
    module_state_flags: tuple[str, ...],
) -> Iterator[tuple[CoordinatorProcess, list[HolderProcess]]]:
    """A coordinator and two holders of 16 frames each (no single one takes a 17-page corpus)."""
    store, _ = corpora
    tmp = tmp_path_factory.mktemp("coord-cluster")
    co = start_coordinator(tmp / "coord", store, "--retry-s", "0.2", *module_state_flags)
    hs = start_holders(store, tmp, tiny_dir, co.address, 2, "--capacity-tokens", "1024")
    yield co, hs
    assert [h.stop() for h in hs] == [0, 0]
    assert co.stop() == 0


def test_fragmented_pin_spans_holders_and_a_queued_pin_lands_when_capacity_frees(
    cluster: tuple[CoordinatorProcess, list[HolderProcess]], corpora: tuple[Path, list[str]]
) -> None:
    co, _ = cluster
    _, (big, small, mid) = corpora

    async def go() -> None:
        async with CoordinatorClient(co.address) as c:
            await c.wait_holders(2)
            t = await c.pin(big)  # 17 pages > 16 frames of either holder: admitted in aggregate
            assert t.corpus.state == "ready" and t.corpus.cp_degree == 2
            assert sorted(t.holders) == sorted(h.info.holder_id for h in await c.list_holders())
            for hid, info in t.holders.items():  # the table's frames are what the holder holds
                hc = HolderClient(info.address)
                held = {x.corpus_id: x for x in (await hc.info()).corpora}
                assert {pf.page: pf.frame for pf in held[big].frames} == t.frames_on(hid)
                await hc.close()
            assert (await c.pin(big)).pages == t.pages  # idempotent
            assert (await c.pin(small)).corpus.state == "ready"  # 27 of 32 frames used
            q = await c.pin(mid)  # 15 pages, 5 free: waits
            assert q.corpus.state == "queued" and q.corpus.queue_position == 1 and not q.pages
            code, msg = await status_of(c.pin(mid, wait=True, timeout=0.5))
            assert code == S.DEADLINE_EXCEEDED, (code, msg)
            code, msg = await status_of(c.page_table(mid))
            assert code == S.FAILED_PRECONDITION and "queued" in msg
            waiter = asyncio.create_task(c.pin(mid, wait=True, timeout=20))
            await asyncio.sleep(0.1)
            assert await c.unpin(big) == 17
            placed = await waiter
            assert placed.corpus.state == "ready" and len(placed.pages) == 15
            listed = await c.list_corpora()
            states = {x.corpus_id: x.state for x in listed}
            assert states == {big: "retired", small: "ready", mid: "ready"}
            # each corpus's head, from its tokens in the store (the SGLang plugin refuses a
            # bound prompt that starts with it)
            store = PageStore(corpora[0])
            for x in listed:
                want = corpus_head(store.read_tokens(x.corpus_id))
                assert (x.head_len, x.head_digest) == want and x.head_len == HEAD_TOKENS, x
            assert await c.unpin(big) == 0  # idempotent once retired
            assert await c.unpin(small) == 10 and await c.unpin(mid) == 15
            assert sum(h.placed_frames for h in await c.list_holders()) == 0

    asyncio.run(go())


def test_bad_input_gets_precise_statuses_and_the_coordinator_keeps_serving(
    cluster: tuple[CoordinatorProcess, list[HolderProcess]],
    corpora: tuple[Path, list[str]],
    tiny_dir: Path,
) -> None:
    co, _ = cluster
    store, (big, small, _) = corpora
    broken = store / "corpora" / ("f" * 32)
    broken.mkdir(exist_ok=True)
    (broken / "manifest.json").write_text('{"format": "corpusd-pages-v1", "name": 3}')
    other = synthetic_corpus(store, tiny_dir, 300)
    m = json.loads((store / "corpora" / other / "manifest.json").read_text())
    m["page_size"], m["n_pages"] = 32, -(-m["token_count"] // 32)  # as if pinned with pages of 32
    m.pop("page_digests", None)  # its digests are of pages of 64 (gone already in a 2nd run)
    (store / "corpora" / other / "manifest.json").write_text(json.dumps(m))

    async def go() -> None:
        async with CoordinatorClient(co.address) as c:
            stub = c.stub
            reg = pb.HolderAddress(holder_id="x", address="", capacity_frames=0)
            cases = [
                (c.pin(""), S.INVALID_ARGUMENT, "corpus_id must be"),
                (c.pin("../etc"), S.INVALID_ARGUMENT, "corpus_id must be"),
                (c.pin("0" * 32), S.NOT_FOUND, "not in the coordinator's store"),
                (c.pin("f" * 32), S.FAILED_PRECONDITION, "unreadable manifest"),
                (c.pin(small, replicas=3), S.FAILED_PRECONDITION, "replicas 3 > 2 live holders"),
                (c.pin(big, replicas=2), S.RESOURCE_EXHAUSTED, "exceed the live holders' capacity"),
                (c.pin(other), S.FAILED_PRECONDITION, "no registered holder can load"),
                (c.page_table("0" * 32), S.NOT_FOUND, "not known"),
                (c.unpin("0" * 32), S.NOT_FOUND, "not known"),
                (c.heartbeat("nobody", 0, 0), S.NOT_FOUND, "not registered"),
                (
                    stub.RegisterHolder(pb.RegisterHolderRequest(holder=reg)),
                    S.INVALID_ARGUMENT,
                    "lacks address, model_fingerprint, dtype, capacity_frames, page_size",
                ),
            ]
            for call, code, msg in cases:
                got = await status_of(call)
                assert got[0] == code and msg in got[1], (code, msg, got)
            await c.pin(small)
            got = await status_of(c.pin(small, replicas=2))
            assert got[0] == S.FAILED_PRECONDITION and "unpin it first" in got[1], got
            # nothing of the refused pins is visible, and the coordinator still serves
            listed = {x.corpus_id: x.state for x in await c.list_corpora()}
            assert set(listed) <= set(corpora[1]) and listed[big] == "retired", listed
            health = health_pb2_grpc.HealthStub(c.channels[0])
            r = await health.Check(health_pb2.HealthCheckRequest(service="corpusd.v1.Coordinator"))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            assert len((await c.page_table(small)).pages) == 10
            await c.unpin(small)

    asyncio.run(go())
    text = urllib.request.urlopen(f"http://127.0.0.1:{co.metrics_port}/metrics", timeout=10)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.read().decode())
        for s in fam.samples
    }
    assert samples[("corpusd_coordinator_holders", (("lease", "live"),))] == 2
    not_found = (("code", "NOT_FOUND"), ("method", "Pin"))
    assert samples[("corpusd_coordinator_requests_total", not_found)] >= 1
    assert samples[("corpusd_coordinator_pins_total", (("outcome", "rejected"),))] >= 1


def test_cli_status_and_pin_publish(
    cluster: tuple[CoordinatorProcess, list[HolderProcess]],
    corpora: tuple[Path, list[str]],
    tiny_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    co, _ = cluster
    store, _ = corpora
    src = store.parent / "repo.tar"  # pin_sample's last source: the 15-page corpus
    args = ["--model", str(tiny_dir), "--store", str(store), "--coordinator", co.address]
    assert cli_main(["pin", "--corpus", str(src), *args]) == 0
    out = capsys.readouterr().out
    assert "already pinned" in out and "published via" in out and "15 pages × 1" in out
    assert cli_main(["status", "--coordinator", co.address]) == 0
    out = capsys.readouterr().out
    assert "holders (2 live of 2)" in out and "ready" in out and "fan-in" in out
    # 2 live holders pass the pre-flight; the coordinator refuses the change of replicas
    assert cli_main(["pin", "--corpus", str(src), *args, "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("corpusd: error: coordinator: FAILED_PRECONDITION: corpus ")
    assert "already ready with replicas 1; unpin it first" in err and err.count("\n") == 1
    asyncio.run(_unpin_all(co.address))


async def _unpin_all(address: str) -> None:
    async with CoordinatorClient(address) as c:
        for x in await c.list_corpora():
            await c.unpin(x.corpus_id)
