"""End to end: 8 sub-agents decode against a corpus pinned across real holder processes, and
every token matches transformers' DeepseekV32ForCausalLM.generate on [corpus + suffix].

The corpus is several times longer than index_topk (128), so the sparse selection is real; its
pages are placed at random over 1, 2 or 3 holders (and, once, with two replicas per page).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from corpusd.corpus.store import PageStore
from corpusd.model import KVCache, forward_tokens
from corpusd.model.rope import shift_band
from corpusd.rpc import StatusError
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.numeric import rel
from corpusd.testing.oracle import Oracle, decode
from corpusd.transport import nvshmem_ring
from holder.launch import HolderProcess
from requester.config import WorkerConfig
from requester.holder_client import HolderClient
from requester.sampling import SamplingParams
from requester.worker import Worker

AGENTS, NEW_TOKENS, CORPUS_TOKENS = 8, 16, 700
SMALL_POOL = ("--capacity-tokens", "4096")
SUFFIXES = [f"\nQ{i}: line {i * 37}?" for i in range(AGENTS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("decode")
    return tmp, pin_sample(tmp, tiny_dir, tokens=CORPUS_TOKENS)


@pytest.fixture(scope="module")
def holders(corpus: tuple[Path, str], tiny_dir: Path) -> Iterator[list[HolderProcess]]:
    tmp, _ = corpus
    # Small pools: a holder preallocates (and zero-fills) its capacity; the default 1M tokens
    # would be ~5.6 GB each.
    procs = [
        start_holder(tmp / "store", tmp / f"holder{i}", tiny_dir, *SMALL_POOL) for i in range(3)
    ]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def oracle(corpus: tuple[Path, str], hf_model) -> Oracle:  # type: ignore[no-untyped-def]
    """transformers' greedy tokens and logits for each agent's [corpus + suffix] (computed at
    the first decode, its tokens checked by one forward each: ``Oracle``)."""
    tmp, cid = corpus
    toks = PageStore(tmp / "store").read_tokens(cid)
    assert len(toks) > 4 * hf_model.config.index_topk, "corpus too short for real selection"
    return Oracle(hf_model, toks, SUFFIXES, NEW_TOKENS)


def place(cid: str, holders: list[HolderProcess], n_pages: int, replicas: int, seed: int) -> None:
    """Release the corpus everywhere, then give each page to ``replicas`` random holders."""

    async def go() -> None:
        rng = random.Random(seed)
        clients = [HolderClient(h.address) for h in holders]
        try:
            for c in clients:
                held = {x.corpus_id for x in (await c.info()).corpora}
                if cid in held:
                    await c.release(cid)
            owners: dict[int, list[int]] = {i: [] for i in range(len(holders))}
            for page in range(n_pages):
                for i in rng.sample(range(len(holders)), replicas):
                    owners[i].append(page)
            for i, pages in owners.items():
                if pages:
                    await clients[i].assign(cid, pages)
        finally:
            for c in clients:
                await c.close()

    asyncio.run(go())


ALL_MODES = [(i, p) for i in ("replica", "distributed") for p in ("route", "fetch", "local")]
# (holders, replicas per page) → (indexer, primitive) runs: every combination on 2 holders, a
# spread elsewhere (each run is 8 agents × 16 steps; the suite has a time budget).
LAYOUTS = {
    (1, 1): [("replica", "route"), ("distributed", "local")],
    (2, 1): ALL_MODES,
    (3, 1): [("distributed", "route"), ("replica", "fetch"), ("distributed", "fetch")],
    (3, 2): [("distributed", "route"), ("replica", "fetch")],
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[f"{h}holders-r{r}" for h, r in LAYOUTS])
def test_agents_match_transformers_generate(  # type: ignore[no-untyped-def]
    tiny_model, corpus, holders, oracle, layout: tuple[int, int]
) -> None:
    tmp, cid = corpus
    store = PageStore(tmp / "store")
    n_holders, replicas = layout
    place(cid, holders[:n_holders], store.manifest(cid).n_pages, replicas, seed=n_holders)
    addresses = [h.address for h in holders[:n_holders]]
    for indexer, primitive in LAYOUTS[layout]:
        cfg = WorkerConfig(indexer=indexer, primitive=primitive, trace=True)
        tokens, logits, w = asyncio.run(
            decode(tiny_model, store, cid, addresses, cfg, SUFFIXES, NEW_TOKENS)
        )
        picks = {t["pick"] for t in w.trace}
        assert picks == {primitive}, f"{indexer=} {primitive=}: predicate picked {picks}"
        if n_holders > 1:
            assert len({t["holder"] for t in w.trace}) == n_holders, "not every holder was used"
        for a, ((ref_tokens, ref_logits), got, got_logits) in enumerate(
            zip(oracle.runs(guess=tokens), tokens, logits, strict=True)
        ):
            ctx = f"{indexer=} {primitive=} {layout=} agent {a}"
            assert got == ref_tokens, f"{ctx}: {got} != {ref_tokens}"
            worst = max(rel(g, r) for g, r in zip(got_logits, ref_logits, strict=True))
            assert worst <= 1e-4, f"{ctx}: logits rel {worst:.2e}"


def shifted_reference(
    model,
    store: PageStore,
    cid: str,
    prefix: list[int],
    suffix: list[int],
    n_new: int,  # type: ignore[no-untyped-def]
) -> tuple[list[int], list[torch.Tensor]]:
    """The model's own monolithic decode over [prefix ‖ corpus ‖ suffix], where the corpus's
    canonical rows are re-derived at positions ``o + j``: their rope bands (k_pe, and the index
    key's) are rotated back to angle 0 and forward to ``o + j`` with absolute angles."""
    cfg, rot = model.cfg, model.rotary
    m = store.manifest(cid)
    t, o = m.token_count, len(prefix)
    cache = KVCache(cfg, o + t + len(suffix) + n_new, torch.float32)
    forward_tokens(model, torch.tensor(prefix), cache, want_logits=False)
    j = torch.arange(t)
    back, fwd = rot.shift(-j), rot.shift(o + j)
    for li in range(cfg.num_hidden_layers):
        lat, keys = store.read_pages(cid, li, list(range(m.n_pages)))
        lat, keys = lat.reshape(-1, lat.shape[-1])[:t], keys.reshape(-1, keys.shape[-1])[:t]
        r = cfg.qk_rope_head_dim
        d_v = cfg.kv_lora_rank
        cache.latent[li][o : o + t] = shift_band(shift_band(lat, d_v, r, *back), d_v, r, *fwd)
        cache.index_keys[li][o : o + t] = shift_band(shift_band(keys, 0, r, *back), 0, r, *fwd)
    cache.length = o + t
    logits = forward_tokens(model, torch.tensor(suffix), cache)
    assert logits is not None
    toks, out = [], []
    for _ in range(n_new):
        out.append(logits[-1])
        toks.append(int(logits[-1].argmax()))
        logits = forward_tokens(model, torch.tensor(toks[-1:]), cache)
        assert logits is not None
    return toks, out


def test_position_independent_reuse_route_fetch_local_agree(tiny_model, corpus, holders) -> None:  # type: ignore[no-untyped-def]
    """The corpus placed after a private prefix (offset 37, not page aligned): routing with the
    query rotated back, fetching with k_pe rotated forward and re-prefilling the canonical chunk
    all equal a reference recomputed with the chunk's keys rotated to the new offset."""
    tmp, cid = corpus
    store = PageStore(tmp / "store")
    place(cid, holders[:2], store.manifest(cid).n_pages, 1, seed=11)
    prefix = list(b"You are agent 7. Read the corpus below.")[:37]
    suffix = list(b"\nWhat is on line 3?")
    ref_tokens, ref_logits = shifted_reference(tiny_model, store, cid, prefix, suffix, 8)
    got: dict[str, list[torch.Tensor]] = {}

    async def run(cfg: WorkerConfig) -> tuple[list[int], list[torch.Tensor]]:
        w = Worker(tiny_model, cfg, store=store)
        try:
            await w.attach(cid, [h.address for h in holders[:2]])
            s = w.open(
                cid, suffix, prefix=prefix, params=SamplingParams(max_tokens=8), keep_logits=True
            )
            await w.generate([s])
            return s.generated, s.logits or []
        finally:
            await w.close()

    for indexer, primitive in [
        ("replica", "route"),
        ("replica", "fetch"),
        ("replica", "local"),
        ("distributed", "route"),
    ]:
        toks, logits = asyncio.run(run(WorkerConfig(indexer=indexer, primitive=primitive)))
        ctx = f"{indexer=} {primitive=}"
        assert toks == ref_tokens, f"{ctx}: {toks} != {ref_tokens}"
        worst = max(rel(g, r) for g, r in zip(logits, ref_logits, strict=True))
        assert worst <= 1e-4, f"{ctx}: logits rel {worst:.2e}"
        got[f"{indexer}-{primitive}"] = logits
    route, fetch = got["replica-route"], got["replica-fetch"]
    assert max(rel(a, b) for a, b in zip(route, fetch, strict=True)) <= 1e-5


def test_calibrate_measures_a_profile_the_predicate_uses(
    tiny_model, corpus, holders, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from requester.calibrate import calibrate
    from requester.predicate import Group, Predicate, Profile

    tmp, cid = corpus
    store = PageStore(tmp / "store")
    place(cid, holders[:1], store.manifest(cid).n_pages, 1, seed=0)

    async def go() -> Profile:
        client = HolderClient(holders[0].address)
        try:
            return await calibrate(
                tiny_model,
                client,
                cid,
                store.read_tokens(cid),
                repeats=2,
                log=lambda _: None,
                grid_rows=(1, 16),
                grid_k=(128, 512),
            )
        finally:
            await client.close()

    prof = asyncio.run(go())
    assert prof.alpha_us > 0 and prof.beta_bytes_per_us > 0 and prof.prefill_us_per_token > 0
    assert prof.holder_partial_us_per_nkh > 0 and prof.local_partial_us_per_nkh > 0
    prof.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    g = Group(
        n=8,
        k=128,
        h=64,
        rows=1024,
        missing_pages=11,
        page_bytes=64 * 576 * 4,
        missing_tokens=700,
        local_ok=True,
    )
    costs = Predicate(loaded).costs(g)
    assert all(v > 0 for v in costs.values()) and costs == Predicate(prof).costs(g)


def test_dead_holder_falls_back_to_local_and_stop_tokens_stop(  # type: ignore[no-untyped-def]
    tiny_model, tiny_dir, corpus, holders, oracle
) -> None:
    """A holder killed (SIGKILL) after attach: its groups are recomputed locally, counted in
    metrics, and the tokens still equal transformers'. A stop token ends a session early."""
    tmp, cid = corpus
    store = PageStore(tmp / "store")
    doomed = start_holder(tmp / "store", tmp / "doomed", tiny_dir, *SMALL_POOL)
    try:
        n_pages = store.manifest(cid).n_pages
        place(cid, holders[:1], n_pages, 1, seed=0)  # holder 0 has every page …
        place(cid, [holders[0], doomed], n_pages, 1, seed=5)  # … then half go to the doomed one
        ref_tokens = oracle.tokens()  # before the decode: its stop token is one of them

        async def run() -> tuple[list[list[int]], list[str], Worker]:
            w = Worker(tiny_model, WorkerConfig(primitive="route"), store=store)
            try:
                await w.attach(cid, [holders[0].address, doomed.address])
                doomed.proc.kill()
                doomed.proc.wait()
                stop = ref_tokens[1][3]
                sessions = [
                    w.open(
                        cid,
                        list(s.encode()),
                        params=SamplingParams(
                            max_tokens=NEW_TOKENS, stop_token_ids=(stop,) if i == 1 else ()
                        ),
                    )
                    for i, s in enumerate(SUFFIXES[:2])
                ]
                await w.generate(sessions)
                return [s.generated for s in sessions], [s.finish_reason for s in sessions], w
            finally:
                await w.close()

        tokens, reasons, w = asyncio.run(run())
        assert tokens[0] == ref_tokens[0]
        cut = ref_tokens[1].index(ref_tokens[1][3]) + 1
        assert tokens[1] == ref_tokens[1][:cut] and reasons == ["length", "stop"]
        # the worker has the page store: the dead holder's pages are read from it (milliseconds),
        # not recomputed (a prefill of the corpus: seconds to minutes)
        fell = w.metrics.fallbacks.labels("route", "store")._value.get()
        assert fell > 1, "the dead holder's groups should have been read from the page store"
        assert w.metrics.fallbacks.labels("route", "local")._value.get() == 0
        # one failed call: a holder that failed with no replica to take over is not called again
        assert w.metrics.errors.labels("UNAVAILABLE")._value.get() == 1
    finally:
        doomed.stop()


class _FailingRoute:
    """What an NVSHMEM route raises when its holder fails mid-call (a StatusError, not a gRPC
    error): the worker must take the same failover path as for gRPC."""

    name = "nvshmem"

    async def attend_rows(self, *args: object, **kwargs: object) -> object:
        raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "no NVSHMEM reply (test)")

    async def close(self) -> None:
        pass


def test_a_failing_nvshmem_route_fails_over_like_grpc(  # type: ignore[no-untyped-def]
    tiny_model, corpus, holders, oracle
) -> None:
    tmp, cid = corpus
    store = PageStore(tmp / "store")
    place(cid, holders[:2], store.manifest(cid).n_pages, 1, seed=3)

    async def run() -> tuple[list[int], Worker]:
        w = Worker(tiny_model, WorkerConfig(primitive="route"), store=store)
        try:
            await w.attach(cid, [h.address for h in holders[:2]])
            # on CPU "auto" picks gRPC for both, without asking the holders
            assert {r.name for r in w.fanout.routes.values()} == {"grpc"}
            w.fanout.routes[holders[1].address] = _FailingRoute()
            s = w.open(cid, list(SUFFIXES[0].encode()), params=SamplingParams(max_tokens=6))
            await w.generate([s])
            return s.generated, w
        finally:
            await w.close()

    tokens, w = asyncio.run(run())
    assert tokens == oracle.answer(0, tokens, n=6)[0]
    assert w.metrics.fallbacks.labels("route", "store")._value.get() > 0  # the worker's store
    assert w.metrics.errors.labels("DEADLINE_EXCEEDED")._value.get() > 0
    info = w.metrics.transport.labels(holders[0].address, "grpc")._value.get()
    assert info == 1 and w.metrics.transport.labels(holders[0].address, "nvshmem")._value.get() == 0


def test_transport_flag_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        WorkerConfig(transport="rdma")
    if not nvshmem_ring.available():
        with pytest.raises(ValueError, match="needs a CUDA GPU and nvshmem4py"):
            WorkerConfig(transport="nvshmem")
