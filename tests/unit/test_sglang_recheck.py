"""The plugin forgets corpora unpinned or placed anew since they were bound
(``CorpusCatalog.recheck``, called by admission at most once a second). The defect: bindings and
the device path's arena were cached for the server's life, so a request bound to a corpus after
its unpin was served from frames the holders had freed (the next pin fills them with another
corpus's rows), and a corpus unpinned and pinned again (same content, same id, other frames) was
read from its old frames: wrong answers, no error. The coordinator's corpora and page tables,
the holders' SharePool and CUDA IPC are faked, as in ``test_sglang_device_fp8``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from corpusd.model import ModelConfig
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.sglang import link as link_mod
from requester.sglang.binding import CorpusBindingError, PinnedCorpus
from tests.unit.test_sglang_device_fp8 import SEED, P, _resident, fake_device_link


def test_a_corpus_unpinned_or_placed_anew_is_forgotten_and_never_read_from_old_frames(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    layers = cfg.num_hidden_layers
    link = fake_device_link(monkeypatch, cfg, {"h0": "one"})

    # what the coordinator says: corpus "docs" (id c1) and where its 3 pages are
    listed = [PinnedCorpus("c1", "docs", "ready", 150, P, "fp")]
    frames = {"c1": [4, 9, 2]}
    table_reads: list[str] = []

    async def list_corpora() -> list[PinnedCorpus]:
        return list(listed)

    async def page_table(cid: str) -> CorpusView:  # as the coordinator's: ready ones only
        table_reads.append(cid)
        if not any(c.corpus_id == cid for c in listed):
            raise CorpusUnavailable(f"corpus {cid} is retired, not ready")
        f = frames[cid]
        return CorpusView(cid, 150, P, ("h0",), torch.zeros(3, dtype=torch.long), torch.tensor(f),
                          tuple(((0, x),) for x in f))  # fmt: skip

    g = torch.Generator().manual_seed(SEED)
    keys = [torch.randn(150, 128, generator=g) for _ in range(layers)]

    async def corpus(cid: str) -> Any:  # as the link's: the cached view, read once per id
        if cid not in link.corpora:

            async def index_keys(layer: int) -> torch.Tensor:
                return keys[layer]

            link.corpora[cid] = SimpleNamespace(view=await page_table(cid), index_keys=index_keys)
        return link.corpora[cid]

    monkeypatch.setattr(link.catalog, "_list", list_corpora)
    monkeypatch.setattr(link.catalog, "_page_table", page_table)
    monkeypatch.setattr(link.catalog, "corpus", corpus)
    try:
        res = _resident(layers)
        assert link.map_holders(res, torch.device("cpu")) == ["h0"]
        first = link.load_resident(link.bind("docs"), res)
        assert first.placement == (("h0", 4), ("h0", 9), ("h0", 2))
        assert link.recheck(res, every_s=0, wait=True) == {}  # nothing changed: nothing forgotten
        assert link.recheck(res, every_s=3600) == {}  # and not asked again within the interval
        assert link.catalog._rechecking is None
        assert res.corpora == {"c1": first}

        listed.clear()  # unpinned
        # admission's call: it starts the re-read on the link's loop and returns at once; a
        # later call applies the answer (here after the first is done)
        link.catalog._checked_at = 0.0
        assert link.recheck(res) == {} and link.catalog._rechecking is not None
        link.catalog._rechecking.result(5)
        assert "c1" in res.corpora  # not applied until the next call, on this thread
        stale = link.recheck(res, every_s=3600)
        assert "c1" in stale and "nothing ready" in stale["c1"]
        assert "c1" not in res.corpora
        with pytest.raises(CorpusBindingError, match="docs"):
            link.bind("docs")  # admission: the next request is refused
        # a request admitted before the recheck reaches its prefill: the forward gets what
        # admission bound and loaded, and raises nothing (a raise stops SGLang's scheduler)
        b = link.bound("docs")
        assert b.corpus_id == "c1"
        assert link.load_resident(b, res, admitted=True) is first

        listed.append(PinnedCorpus("c1", "docs", "ready", 150, P, "fp"))  # pinned again,
        frames["c1"] = [7, 1, 5]  # into other frames
        again = link.load_resident(link.bind("docs"), res)
        assert again.placement == (("h0", 7), ("h0", 1), ("h0", 5))
        assert again.base_page != first.base_page  # new arena pages; old requests keep theirs
        assert res.page_frame[again.base_page : again.base_page + 3].tolist() == [7, 1, 5]

        # unpinned and pinned again between two rechecks: the name still means c1, but the
        # frames differ from what the arena holds
        frames["c1"] = [3, 8, 6]
        stale = link.recheck(res, every_s=0, wait=True)
        assert stale == {"c1": "was placed anew (unpinned and pinned again)"}
        # an admitted request's forward loads the new frames (the corpus is ready)
        moved = link.load_resident(link.bound("docs"), res, admitted=True)
        assert moved.placement[0] == ("h0", 3)
        assert link.load_resident(link.bind("docs"), res) is moved
    finally:
        link.close()


def test_a_coordinator_that_does_not_answer_changes_nothing(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recheck that cannot reach the coordinator keeps every binding (logged), so a brief
    coordinator outage does not refuse requests to corpora still pinned."""
    cfg = ModelConfig.from_dir(tiny_dir)
    link = link_mod.CorpusLink("127.0.0.1:1", cfg, "fp", P, table_refresh_s=-1)

    async def down() -> list[PinnedCorpus]:
        raise ConnectionError("coordinator 127.0.0.1:1 unreachable")

    monkeypatch.setattr(link.catalog, "_list", down)
    try:
        link.catalog._bindings["docs"] = link_mod.Binding("c1", "docs", 150, P)
        assert link.recheck(None, every_s=0, wait=True) == {}
        assert link.bind("docs").corpus_id == "c1"
    finally:
        link.close()
