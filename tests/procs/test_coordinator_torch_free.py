"""The coordinator is control plane: it lists, names, places and times corpora, and reads no
tensor, so it runs without torch (``corpusd/corpus/store.py`` imports torch only where a tensor
is read or written; the head digest reads the token ids with numpy): serving ~0.7 s after
spawn and ~60 MB, not ~2.7 s and ~245 MB (``tools/coordinator_footprint.py``). A real coordinator
on loopback, a stored corpus listed with its head digest (the one place it reads a corpus's
file), then its process's memory map."""

from __future__ import annotations

import asyncio
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.head import corpus_head
from corpusd.corpus.store import PageStore
from corpusd.testing.holders import pin_sample


def test_the_coordinator_serves_its_listing_without_torch(tmp_path: Path, tiny_dir: Path) -> None:
    cid = pin_sample(tmp_path, tiny_dir, tokens=300)
    store = PageStore(tmp_path / "store")
    co = start_coordinator(tmp_path / "coord", tmp_path / "store")
    try:

        async def listed() -> list:  # type: ignore[type-arg]
            async with CoordinatorClient(co.address) as cc:
                return await cc.list_corpora(stored=True)

        (info,) = [c for c in asyncio.run(listed()) if c.corpus_id == cid]
        # the head it serves is the one torch's token read gives
        assert (info.head_len, info.head_digest) == corpus_head(store.read_tokens(cid))
        assert info.head_len > 0
        maps = Path(f"/proc/{co.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the coordinator loaded torch"
    finally:
        co.stop()


def test_token_ids_read_without_torch_equal_the_tensor_read(tmp_path: Path, tiny_dir: Path) -> None:
    cid = pin_sample(tmp_path, tiny_dir, tokens=300)
    store = PageStore(tmp_path / "store")
    ids, tokens = store.read_token_ids(cid), store.read_tokens(cid)
    assert ids.dtype.str == "<i4" and ids.tolist() == tokens.tolist()
