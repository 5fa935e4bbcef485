"""The fuzz suite, CI-sized: 1,500 requests drawn around valid ones (corpusd/testing/fuzzing.py)
to every RPC of a real coordinator, two holders and an agent worker. Every answer is a precise
status (never INTERNAL or UNKNOWN, no hang), every daemon stays up and SERVING, and a normal
session afterwards still decodes transformers' tokens. ``python -m tools.fuzz`` runs 10,000+."""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corpusd.corpus.store import PageStore
from corpusd.testing.fuzzing import TARGETS, Fuzzer, decode, fuzz_cluster
from corpusd.testing.oracle import greedy

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
        [(want, _)] = greedy(hf_model, tokens, [PROMPT], 8)
        assert got == want
