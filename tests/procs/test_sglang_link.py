"""The SGLang plugin's corpusd side on CPU: binding against a real coordinator, the corpus's index
keys from a real holder, and the HiCache page index and backend over a real page store (no sglang
needed)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from corpusd.corpus.store import PageStore
from corpusd.kernels.reference import partial_attention
from corpusd.model import ModelConfig, fingerprint
from corpusd.testing.numeric import rel
from corpusd.testing.tcp_proxy import Proxy
from indexer.fp8 import hadamard
from requester.predicate import Predicate, Profile
from requester.sglang.binding import CorpusBindingError
from requester.sglang.choose import Chooser
from requester.sglang.link import CorpusLink
from requester.sglang.metrics import PluginMetrics
from requester.sglang.pagehash import index_k_from_page, index_k_page, page_hashes
from requester.sglang.pages import CorpusPages
from requester.sglang.positions import to_corpusd_layout
from tests.support.sglang_cluster import TOKENS, Cluster, start_cluster
from tests.support.sglang_host import load_hicache


@pytest.fixture(scope="module")
def tiny_dir(sglang_dir: Path) -> Path:
    """This module sizes its corpora in byte tokens and needs V3.2's 64 × 128 indexer (fp8 index
    arithmetic quantizes 128-wide keys): the sglang preset, not the CPU default."""
    return sglang_dir


def _cfg(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory, tiny_dir)


def test_link_binds_pinned_corpora_and_says_why_not(cluster: Cluster, tiny_dir: Path) -> None:
    link = CorpusLink(cluster.coord.address, _cfg(tiny_dir), fingerprint(tiny_dir), 64)
    try:
        name = PageStore(cluster.store).manifest(cluster.corpus_id).name
        b = link.bind(name)
        assert (b.corpus_id, b.tokens, b.page_size) == (cluster.corpus_id, TOKENS, 64)
        assert link.bind(cluster.corpus_id[:10]) == b
        with pytest.raises(CorpusBindingError, match=f"unknown corpus 'nope'; pinned: {name}"):
            link.bind("nope")
    finally:
        link.close()
    other = CorpusLink(cluster.coord.address, _cfg(tiny_dir), "sha256:other", 64)
    try:
        with pytest.raises(CorpusBindingError, match="but this SGLang server runs sha256:other"):
            other.bind(name)
    finally:
        other.close()
    with pytest.raises(ValueError, match="CORPUSD_COORDINATOR"):
        CorpusLink("", _cfg(tiny_dir), "x", 64)


def test_link_index_keys_are_the_stores_at_sglang_fp8_precision(
    cluster: Cluster, tiny_dir: Path
) -> None:
    link = CorpusLink(cluster.coord.address, _cfg(tiny_dir), fingerprint(tiny_dir), 64)
    try:
        b = link.bind(cluster.corpus_id)
        got = link.index_keys(b, 1, torch.device("cpu"), ue8m0=True)
    finally:
        link.close()
    ps = PageStore(cluster.store)
    _, idx = ps.read_pages(cluster.corpus_id, 1, list(range(4)))
    want = idx.reshape(-1, idx.shape[-1])[:TOKENS].float()
    assert got.shape == want.shape
    exact = torch.cat([index_k_from_page(index_k_page(p.float(), True)) for p in idx])[:TOKENS]
    assert torch.equal(got, exact)  # the same fp8 round trip SGLang applies to its own keys
    # ... to the keys after SGLang's Hadamard rotation, which its queries also get
    assert 0 < rel(got, hadamard(want)) < 0.06


def test_link_attend_is_the_corpus_partial_from_inside_a_sync_caller(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """SGLang's forward is synchronous: the link runs corpusd's asyncio clients on its own loop
    thread and calls the holders straight. Many calls in a row (one per layer and step in a
    server): the clients made by the first are reused on its loop."""
    cfg = ModelConfig.from_dir(tiny_dir)
    ps = PageStore(cluster.store)
    lat, _ = ps.read_pages(cluster.corpus_id, 1, list(range(4)))
    rows = lat.reshape(-1, cfg.kv_dim)[:TOKENS]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.randint(-1, TOKENS, (3, 40), generator=g)
    link = CorpusLink(cluster.coord.address, _cfg(tiny_dir), fingerprint(tiny_dir), 64)
    try:
        b = link.bind(cluster.corpus_id)
        first = link.attend(b, 1, q, pos, cfg.softmax_scale)
        for _ in range(40):
            o, lse = link.attend(b, 1, q, pos, cfg.softmax_scale)
        # every route call timed once for the replica spread (balance.py, in the shared fan-out)
        speed = link.corpora[cluster.corpus_id].speed
        assert speed.calls == {cluster.holders[0].address: 41}, speed.calls
    finally:
        link.close()
    assert torch.equal(first[0], o) and torch.equal(first[1], lse)
    ro, rl = partial_attention(q.float(), rows, pos, cfg.softmax_scale, cfg.kv_lora_rank)
    assert rel(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)


def test_link_attend_fails_over_like_the_worker_when_a_holder_call_fails(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """A page table that names a holder that is gone (as after a re-placement): the holder call
    fails, no replica in the stale table is left, so the link's binding (corpusd's shared
    fan-out) re-reads the page table from the coordinator and serves the call from the holder it
    names now, with the same bits."""
    cfg = ModelConfig.from_dir(tiny_dir)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.randint(-1, TOKENS, (2, 30), generator=g)
    link = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64)
    try:
        b = link.bind(cluster.corpus_id)
        want = link.attend(b, 0, q, pos, cfg.softmax_scale)
        binding = link.corpora[cluster.corpus_id]
        view = binding.view
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            gone = f"127.0.0.1:{s.getsockname()[1]}"
        binding.view = replace(view, holders=(gone,) * len(view.holders))
        failed_over = link.attend(b, 0, q, pos, cfg.softmax_scale)
        assert binding.view.holders == view.holders and not binding.dead
        fallbacks = link.fanout.metrics.fallbacks.labels("route", "table")._value.get()
    finally:
        link.close()
    assert fallbacks == 1
    assert torch.equal(failed_over[0], want[0]) and torch.equal(failed_over[1], want[1])


def test_link_fails_a_silent_holder_over_at_the_holder_deadline(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """A holder that accepts and never answers (SIGSTOPped, or a partition): the plugin's calls
    to it, once it has answered that shape, wait ``CORPUSD_SGLANG_HOLDER_DEADLINE_S`` (here
    0.5 s), not the 60 s call timeout; its rows then go where the page table says, with the same
    bits. Proxies stand in front of the holders, and the partition is theirs."""
    cfg = ModelConfig.from_dir(tiny_dir)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.randint(-1, TOKENS, (2, 30), generator=g)
    link = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64, holder_deadline_s=0.5)
    proxies: list[Proxy] = []
    try:
        b = link.bind(cluster.corpus_id)
        link.attend(b, 0, q, pos, cfg.softmax_scale)  # the binding's view is made
        binding = link.corpora[cluster.corpus_id]
        view = binding.view
        proxies = [Proxy(h) for h in view.holders]
        binding.view = replace(view, holders=tuple(p.address for p in proxies))
        want = link.attend(b, 0, q, pos, cfg.softmax_scale)  # warms the shape up via the proxies
        for p in proxies:
            p.set("drop")
        t0 = time.monotonic()
        failed_over = link.attend(b, 0, q, pos, cfg.softmax_scale)
        stalled = time.monotonic() - t0
        assert binding.view.holders == view.holders  # the table's, past the proxies
        fallbacks = link.fanout.metrics.fallbacks.labels("route", "table")._value.get()
        errors = link.fanout.metrics.errors.labels("DEADLINE_EXCEEDED")._value.get()
    finally:
        link.close()
        for p in proxies:
            p.close()
    assert stalled < 5.0, f"a silent holder stalled the call {stalled:.1f} s"
    assert fallbacks == 1 and errors >= 1
    assert torch.equal(failed_over[0], want[0]) and torch.equal(failed_over[1], want[1])


def test_corpus_pages_serve_a_prompt_that_starts_with_the_corpus(
    cluster: Cluster, tiny_dir: Path
) -> None:
    ps = PageStore(cluster.store)
    pages = CorpusPages(cluster.store, fingerprint(tiny_dir))
    tokens = ps.read_tokens(cluster.corpus_id).tolist()
    prompt = [*tokens, 1, 2, 3, *range(100)]  # corpus, then the request's own suffix
    keys = page_hashes(prompt)
    assert pages.prefix_hits(keys) == TOKENS // 64 == 3  # the partial 4th page is SGLang's
    assert pages.prefix_hits(page_hashes([5, *prompt])) == 0  # shifted: other keys
    assert CorpusPages(cluster.store, "sha256:other").prefix_hits(keys) == 0
    kv, index_pages = pages.host_page(keys[2], "layer_first", torch.float32)
    layers = ps.manifest(cluster.corpus_id).n_layers
    lat = torch.stack([ps.read_pages(cluster.corpus_id, li, [2])[0][0] for li in range(layers)])
    assert torch.equal(to_corpusd_layout(kv.view(layers, 64, 576)), lat.float())
    assert len(index_pages) == layers and index_pages[0].shape == (64 * 128 + 64 * 4,)


def test_hicache_backend_acknowledges_writes_of_held_pages_and_writes_nothing(
    cluster: Cluster, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang offers every page it computed back to storage, counting any False as a failed write
    (``cache_controller._page_backup``). The corpus's own pages are held already (a key is the
    chained hash of the page's tokens and all before them): those succeed; others fail."""
    hicache = load_hicache(monkeypatch)
    extra = {"corpusd_store": str(cluster.store), "model_path": str(tiny_dir)}
    backend = hicache.CorpusdHiCacheStorage(SimpleNamespace(extra_config=extra, model_name="x"))
    backend.mem_pool_host = None  # a set that read the host pool would raise
    tokens = PageStore(cluster.store).read_tokens(cluster.corpus_id).tolist()
    keys = page_hashes([*tokens, *range(60)])  # 3 corpus pages; the 4th ends in the request's
    assert len(keys) == 4 and backend.batch_exists(keys) == 3

    def files() -> dict[Path, tuple[int, int]]:
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in cluster.store.rglob("*")}

    before = files()
    assert backend.batch_set_v1(keys, torch.arange(4 * 64)) == [True, True, True, False]
    assert backend.batch_set_v1(keys[3:], torch.arange(64)) == [False]
    pages = [torch.zeros(1)] * 4  # the v0 interface passes the host's data pages
    assert backend.batch_set(keys[:3], pages[:3]) is True
    assert backend.batch_set(keys, pages) is False
    assert backend.set(keys[0], pages[0]) is True and backend.set(keys[3], pages[3]) is False
    assert files() == before, "a set wrote to the page store"
    assert backend.batch_exists(keys) == 3  # and nothing joined the index


# -- the predicate inside SGLang: route vs fetch through the plugin's page cache (issue 17) -------
def _fetch_link(
    cluster: Cluster, tiny_dir: Path, force: str, cache_bytes: int, trace: Path | None = None
) -> CorpusLink:
    cfg = _cfg(tiny_dir)
    chooser = Chooser(Predicate(Profile(), force), PluginMetrics(), str(trace) if trace else None)
    return CorpusLink(
        cluster.coord.address, cfg, fingerprint(tiny_dir), 64, chooser=chooser,
        cache_bytes=cache_bytes,
    )  # fmt: skip


def _counter(link: CorpusLink, metric: str, *labels: str) -> float:
    m = getattr(link.metrics, metric)
    return float((m.labels(*labels) if labels else m)._value.get())


def test_fetch_through_the_page_cache_is_route_to_float_tolerance(
    cluster: Cluster, tiny_dir: Path, tmp_path: Path
) -> None:
    """Forced fetch pulls the selected pages from the real holder into the plugin's page cache
    and attends them with the plugin's sparse partial (the torch reference on CPU): the same
    partial as forced route (the holder's kernel), on the first step (every page missing) and
    the next (every page cached, nothing pulled); each decision is traced with its predicted
    and measured cost."""
    cfg = ModelConfig.from_dir(tiny_dir)
    ps = PageStore(cluster.store)
    lat, _ = ps.read_pages(cluster.corpus_id, 1, list(range(4)))
    rows = lat.reshape(-1, cfg.kv_dim)[:TOKENS].float()
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.randint(-1, TOKENS, (3, 50), generator=g)
    pos[1] = -1  # a row with nothing of the corpus selected
    route = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64)
    trace = tmp_path / "trace.jsonl"
    fetch = _fetch_link(cluster, tiny_dir, "fetch", 64 << 20, trace)
    try:
        b = route.bind(cluster.corpus_id)
        want = route.attend(b, 1, q, pos, cfg.softmax_scale)
        fetch.new_step(["r0"], "decode")
        first = fetch.attend(fetch.bind(cluster.corpus_id), 1, q, pos, cfg.softmax_scale)
        pulled = _counter(fetch, "fetched_bytes")
        fetch.new_step(["r0"], "decode")
        second = fetch.attend(fetch.bind(cluster.corpus_id), 1, q, pos, cfg.softmax_scale)
        assert _counter(fetch, "fetched_bytes") == pulled > 0  # the second pulled nothing
        assert _counter(fetch, "cache_lookups", "hit") == len((pos[pos >= 0] // 64).unique())
    finally:
        route.close()
        fetch.close()
    ro, rl = partial_attention(q.float(), rows, pos, cfg.softmax_scale, cfg.kv_lora_rank)
    for o, lse in (first, second):
        # The holder returns O in the query's dtype (bf16 on the wire), and fetch rounds its O
        # the same way, so the two primitives agree to a rare bf16 ulp (float32 O parted them at
        # 2 of 64 teacher-forced near-ties on an H100), and both are the reference rounded.
        assert rel(o, want[0]) < 2e-4 and torch.allclose(lse, want[1], atol=1e-4)
        assert rel(o, ro) < 4e-3 and torch.equal(torch.isinf(lse), torch.isinf(rl))
        assert torch.allclose(lse[~torch.isinf(rl)], rl[~torch.isinf(rl)], atol=1e-5)
    assert bool(torch.isinf(first[1][1]).all()) and bool((first[0][1] == 0).all())
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    steps = [(x["step"], x["pick"], x["force"]) for x in lines]
    assert steps == [(1, "fetch", "fetch"), (2, "fetch", "fetch")]
    assert lines[0]["fetched_pages"] == 4 and lines[1]["fetched_pages"] == 0
    assert all(x["measured_us"] > 0 and x["predicted_us"]["route"] > 0 for x in lines)
    assert lines[0]["rids"] == ["r0"] and lines[0]["holder"] == cluster.holders[0].address


def test_auto_decides_per_group_and_fetch_falls_back_to_route_when_it_cannot(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """Auto records one decision per holder group with both costs predicted; a forced fetch
    whose pages do not fit the cache, or whose holder call fails, routes instead (counted as a
    fallback) with the same result."""
    cfg = ModelConfig.from_dir(tiny_dir)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.arange(0, TOKENS, 5)[None].repeat(2, 1)  # every page of the corpus
    route = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64)
    auto = _fetch_link(cluster, tiny_dir, "auto", 64 << 20)
    one_page = cfg.num_hidden_layers * 64 * cfg.kv_dim * 4  # float32 on CPU: one slot a layer
    small = _fetch_link(cluster, tiny_dir, "fetch", one_page)
    broken = _fetch_link(cluster, tiny_dir, "fetch", 64 << 20)
    try:
        want = route.attend(route.bind(cluster.corpus_id), 0, q, pos, cfg.softmax_scale)
        got_auto = auto.attend(auto.bind(cluster.corpus_id), 0, q, pos, cfg.softmax_scale)
        picks = {p: _counter(auto, "decisions", p, "no") for p in ("route", "fetch")}
        assert sum(picks.values()) == 1  # one holder: one group, one decision
        assert auto.chooser.predicate.profile.splice_us_per_row == 0  # measured here instead
        got_small = small.attend(small.bind(cluster.corpus_id), 0, q, pos, cfg.softmax_scale)
        assert _counter(small, "fallbacks", "fetch", "route") == 1
        assert _counter(small, "decisions", "route", "yes") == 1
        b = broken.bind(cluster.corpus_id)
        broken.attend(b, 0, q, pos[:, :1], cfg.softmax_scale)  # binds; caches page 0
        binding = broken.corpora[cluster.corpus_id]
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            gone = f"127.0.0.1:{s.getsockname()[1]}"
        binding.view = replace(binding.view, holders=(gone,) * len(binding.view.holders))
        broken.new_step([], "decode")
        got_broken = broken.attend(b, 0, q, pos, cfg.softmax_scale)
        assert _counter(broken, "fallbacks", "fetch", "route") == 1
        # pages 1-3 were planned, never filled: not cached (a later hit would read NaN)
        assert broken.host.cache is not None
        assert broken.host.cache.missing(0, cluster.corpus_id, [0, 1, 2, 3]) == 3
    finally:
        for link in (route, auto, small, broken):
            link.close()
    for o, lse in (got_auto, got_small, got_broken):
        assert rel(o, want[0]) < 4e-3 and torch.allclose(lse, want[1], atol=1e-4)


def test_fetched_pages_the_cache_cannot_hold_route_instead(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """A holder that answers Fetch with pages that are not float rows of the model's width (as
    a pin in FlashMLA's fp8 page format would): the forward does not fail; the group routes,
    counted, and nothing enters the cache."""
    cfg = ModelConfig.from_dir(tiny_dir)
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.randint(0, TOKENS, (2, 30), generator=g)
    route = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64)
    link = _fetch_link(cluster, tiny_dir, "fetch", 64 << 20)
    try:
        want = route.attend(route.bind(cluster.corpus_id), 1, q, pos, cfg.softmax_scale)
        b = link.bind(cluster.corpus_id)

        async def made_on_the_links_loop() -> Any:
            return link.fanout.client(cluster.holders[0].address)

        client = link.catalog.run(made_on_the_links_loop())

        async def fp8_pages(corpus_id: str, pages: list[int], **kw: object) -> tuple:
            return [torch.zeros(len(pages), 64, 656, dtype=torch.uint8)], []

        client.fetch = fp8_pages
        got = link.attend(b, 1, q, pos, cfg.softmax_scale)
        assert _counter(link, "fallbacks", "fetch", "route") == 1
        assert link.host.cache is not None and link.host.cache.stats()["resident"] == 0
    finally:
        route.close()
        link.close()
    assert rel(got[0], want[0]) < 1e-6 and torch.equal(got[1], want[1])
