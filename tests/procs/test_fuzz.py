"""The fuzz suite, CI-sized: 1,500 requests drawn around valid ones (corpusd/testing/fuzzing.py)
to every RPC of a real coordinator, two holders and an agent worker. Every answer is a precise
status (never INTERNAL or UNKNOWN, no hang), every daemon stays up and SERVING, and a normal
session afterwards still decodes transformers' tokens. ``python -m tools.fuzz`` runs 10,000+."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corpusd import heap
from corpusd.corpus.store import PageStore
from corpusd.testing.fuzzing import TARGETS, Fuzzer, decode, fuzz_cluster
from corpusd.testing.oracle import greedy
from tests.support.checks import metric

N, SEED = 1500, 20
PROMPT = "\nQ: what is on line 12?"


async def _serving(address: str) -> bool:
    async with aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return r.status == health_pb2.HealthCheckResponse.SERVING


def test_fuzzed_requests_get_precise_statuses_and_every_daemon_keeps_serving(
    tmp_path: Path,
    tiny_dir: Path,
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    with fuzz_cluster(tmp_path, tiny_dir) as cluster:
        ctx = cluster.ctx

        async def fuzz() -> Fuzzer:
            f = Fuzzer(ctx, cluster.addresses, SEED)
            await f.run(N, concurrency=8)
            await f.close()
            return f

        tally = asyncio.run(fuzz()).tally
        assert tally.total == N
        assert not tally.failures, "\n".join(map(str, tally.failures[:20])) + "\n" + tally.table()
        assert {r for r, _ in tally.codes} == {t.name for t in TARGETS}  # every RPC was hit
        assert set(tally.kinds) == {"valid", "fields", "tensor", "bytes", "huge"}
        codes = tally.by_code()
        for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED"):
            assert codes[code] > 0, tally.table()  # the checks past the first were reached
        assert all(cluster.alive().values()), cluster.alive()
        addresses = [d.address for d in cluster.daemons.values()]
        assert [asyncio.run(_serving(a)) for a in addresses] == [True] * len(addresses)
        got = asyncio.run(decode(cluster.agent.address, ctx.corpus_name, list(PROMPT.encode()), 8))
        tokens = PageStore(cluster.store).read_tokens(ctx.corpus_id)
        [(want, _)] = greedy(hf_model, tokens, [PROMPT], 8, guess=[got])
        assert got == want


def _heap(port: int) -> tuple[float, float]:
    """A daemon's glibc heap (in use, free) from its /metrics."""
    return metric(port, "corpusd_heap_bytes", 'state="in_use"'), metric(
        port, "corpusd_heap_bytes", 'state="free"'
    )


@pytest.mark.skipif(heap.heap() is None, reason="needs glibc's mallinfo2 (glibc >= 2.33)")
def test_fuzzed_attend_leaves_no_heap_in_use_behind_on_the_holders(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34's fuzz RSS growth, bounded: 1,600 fuzzed Attend calls, multi-MB tensors among
    them. The heap the holders use stays within 1.3x (+16 MiB) of what it was after the warm-up:
    no leak (a leak of 10 KB a call would pass; one of 40 KB would not). Measured, it wanders
    by up to 30 % between rounds with no trend (shape-keyed kernel caches); what RSS keeps
    beyond it is glibc's free pages, handed back every CORPUSD_MALLOC_TRIM_S (1 s here). The
    agent's share, prompts built only to be refused, has its own test
    (tests/unit/test_agent_prompt_size.py)."""
    monkeypatch.setenv("CORPUSD_MALLOC_TRIM_S", "1")
    with fuzz_cluster(tmp_path, tiny_dir) as cluster:

        async def fuzz(n: int, seed: int) -> None:
            f = Fuzzer(cluster.ctx, cluster.addresses, seed, frozenset({"holder.Attend"}))
            await f.run(n, concurrency=8)
            await f.close()
            await asyncio.sleep(2.5)  # idle: a trim has run

        holders = {f"holder{i}": h for i, h in enumerate(cluster.holders)}
        asyncio.run(fuzz(400, SEED + 1))  # warm-up: imports, pools, kernels
        before = {n: _heap(d.metrics_port) for n, d in holders.items()}
        rss0 = cluster.rss_kib()
        asyncio.run(fuzz(1600, SEED + 2))
        after = {n: _heap(d.metrics_port) for n, d in holders.items()}
        rss1 = cluster.rss_kib()
    report = {
        n: f"in use {before[n][0] / 2**20:.0f} -> {after[n][0] / 2**20:.0f} MiB, free "
        f"{before[n][1] / 2**20:.0f} -> {after[n][1] / 2**20:.0f} MiB, RSS "
        f"{rss0[n] >> 10} -> {rss1[n] >> 10} MiB"
        for n in holders
    }
    print(report)
    for n in holders:
        assert after[n][0] <= before[n][0] * 1.3 + (16 << 20), f"{n}: heap in use grew: {report}"
