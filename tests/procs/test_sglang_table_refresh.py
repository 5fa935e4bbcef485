"""The SGLang plugin's link follows a bound corpus's page table (issue 21), on a real coordinator
and 2 real holders (no sglang): the corpus is pinned whole on one holder and three links bind
and attend it; then synthetic load reports (the holder's heartbeat, sent by the test) make the
leader add a load replica of three hot pages on the other holder. A link that re-reads
(``table_refresh_s``, the plugin's ``CORPUSD_SGLANG_TABLE_REFRESH_S``) stages the new view
within an interval and adopts it at the next forward's first layer — a layer-1 call before it
still plans on the old view — after which its route calls reach the copy's holder (its Attend
count rises); one with -1 never does. Fetch through the plugin's page cache follows too: the
pages it cached stay valid (keyed by corpus and page, not by frame), and pages it misses come
from the copy's holder. Every result is the reference's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.kernels.reference import partial_attention
from corpusd.model import ModelConfig, fingerprint
from corpusd.testing.holders import start_holders, synthetic_corpus
from corpusd.testing.numeric import rel
from requester.predicate import Predicate, Profile
from requester.sglang.choose import Chooser
from requester.sglang.follow import lease_third
from requester.sglang.link import CorpusLink
from requester.sglang.metrics import PluginMetrics
from tests.support.checks import metric

TOKENS, PAGES = 600, 10
HOT = {2: 100, 5: 50, 9: 7}  # page → hits: pages 5 and 9 are served by the copy (p % 2 == 1)
EVERY_S = 0.3


def _rereads(link: CorpusLink, result: str) -> float:
    return float(link.metrics.rereads.labels(result)._value.get())


def test_the_links_attends_reach_a_load_replica_after_one_reread(
    tmp_path: Path, tiny_dir: Path
) -> None:
    store = tmp_path / "store"
    cid = synthetic_corpus(store, tiny_dir, TOKENS)
    profile = tmp_path / "profile.json"
    profile.write_text('{"cp_buckets": [[null, 1]]}')  # the whole corpus on one holder
    co = start_coordinator(
        tmp_path / "coord", store, "--profile", str(profile), "--lease-s", "30",
        "--replica-window-s", "1", "--release-grace-s", "60",
    )  # fmt: skip
    hs = start_holders(store, tmp_path, tiny_dir, co.address, 2, "--capacity-tokens", "1024")
    cfg = ModelConfig.from_dir(tiny_dir)
    ps = PageStore(store)
    rows = {li: ps.read_pages(cid, li, list(range(PAGES)))[0].reshape(-1, cfg.kv_dim)[:TOKENS]
            for li in range(2)}  # fmt: skip
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.stack([torch.arange(0, TOKENS, 7), torch.arange(3, TOKENS, 7)])  # every page
    ref = {li: partial_attention(q.float(), r.float(), pos, cfg.softmax_scale, cfg.kv_lora_rank)
           for li, r in rows.items()}  # fmt: skip
    fp = fingerprint(tiny_dir)
    following = CorpusLink(co.address, cfg, fp, 64, table_refresh_s=EVERY_S)
    fixed = CorpusLink(co.address, cfg, fp, 64, table_refresh_s=-1)
    fetching = CorpusLink(
        co.address, cfg, fp, 64, cache_bytes=64 << 20, table_refresh_s=EVERY_S,
        chooser=Chooser(Predicate(Profile(), "fetch"), PluginMetrics()),
    )  # fmt: skip
    results: list[tuple[str, int, tuple[torch.Tensor, torch.Tensor]]] = []

    def attend(link: CorpusLink, layer: int) -> None:
        link.new_step(["r0"], "decode")
        out = link.attend(link.bind(cid), layer, q, pos, cfg.softmax_scale)
        results.append(("fetch" if link is fetching else "route", layer, out))

    async def go() -> None:
        async with CoordinatorClient(co.address) as c:
            await c.wait_holders(2)
            t = await c.pin(cid)
            (src,) = t.holders
            dst = next(h for h in hs if h.address != t.address(src))

            def served(method: str) -> float:  # by the copy's holder
                return metric(dst.metrics_port, "corpusd_holder_requests_total", method)

            for link in (following, fixed, fetching):
                await asyncio.to_thread(attend, link, 0)
            assert served('method="Attend"') == served('method="Fetch"') == 0
            assert await lease_third(c) == 10.0  # the default interval: the lease (30 s) / 3

            async def heat() -> None:  # fan-in 20 past the elbow 8, for the whole test
                while True:
                    hot = [(cid, p, n) for p, n in HOT.items()]
                    await c.heartbeat(src, PAGES, 0, 8, 0, hot, fanin_mean=20.0)
                    await asyncio.sleep(0.2)

            heating = asyncio.create_task(heat())
            try:
                deadline = time.monotonic() + 30
                while max(len(r) for r in (await c.page_table(cid)).pages) < 2:
                    assert time.monotonic() < deadline, "no load replica within 30 s"
                    await asyncio.sleep(0.1)
                added = time.monotonic()
                while min(_rereads(x, "changed") for x in (following, fetching)) < 1:
                    assert time.monotonic() - added < 10, "the links never saw the new table"
                    await asyncio.sleep(0.05)
                staged_after = time.monotonic() - added

                # staged, not adopted: a layer-1 call is mid-forward and keeps the old view
                await asyncio.to_thread(attend, following, 1)
                assert served('method="Attend"') == 0
                await asyncio.to_thread(attend, following, 0)  # the next forward adopts it
                after_adopt = served('method="Attend"')
                assert after_adopt > 0, "the link's attends never reached the copy"
                await asyncio.to_thread(attend, following, 1)
                assert served('method="Attend"') > after_adopt

                before = served('method="Attend"')
                for layer in (0, 1, 0):  # never re-reads: the copy's holder is not called
                    await asyncio.to_thread(attend, fixed, layer)
                assert served('method="Attend"') == before
                assert sum(_rereads(fixed, r) for r in ("changed", "unchanged", "failed")) == 0

                await asyncio.to_thread(attend, fetching, 0)  # adopts; every page cached
                assert served('method="Fetch"') == 0
                await asyncio.to_thread(attend, fetching, 1)  # layer 1's pages: from both
                assert served('method="Fetch"') > 0
            finally:
                heating.cancel()
            assert staged_after < 3 * EVERY_S + 1, f"{staged_after=}"

    try:
        asyncio.run(go())
    finally:
        for link in (following, fixed, fetching):
            link.close()
        for d in (*hs, co):
            d.stop()
    for kind, layer, (o, lse) in results:
        ro, rl = ref[layer]
        # fetch's O is rounded to q's dtype (bf16) as a holder's reply is: both within bf16
        assert rel(o, ro) < (1e-2 if kind == "route" else 4e-3), f"{kind=} {layer=}"
        assert torch.allclose(lse, rl, atol=1e-3), f"{kind=} {layer=}"
    assert len(results) == 11
