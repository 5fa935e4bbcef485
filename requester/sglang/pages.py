"""Pinned corpora's pages by SGLang page hash, in SGLang's host layout (the fetch path's data).

The HiCache backend (:mod:`.hicache`) is a thin adapter over this; this module imports no sglang,
so CPU tests cover the index and the bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from corpusd.corpus.store import PageStore
from requester.sglang.pagehash import host_kv_page, index_k_from_page, index_k_page, page_hashes


class CorpusPages:
    """Every whole page of every ready corpus in ``store`` pinned for ``model_fingerprint``,
    keyed by its SGLang page hash (chained from the root: the corpus starts the prompt)."""

    def __init__(self, store: str | Path, model_fingerprint: str) -> None:
        self.store: PageStore | None = PageStore(store)
        self.pages: dict[str, tuple[str, int]] = {}  # page hash → (corpus id, page)
        for cid in self.store.ids():
            m = self.store.manifest(cid)
            if m.state != "ready" or m.model_fingerprint != model_fingerprint:
                continue
            tokens = self.store.read_tokens(cid).tolist()
            for p, h in enumerate(page_hashes(tokens, m.page_size)):
                self.pages[h] = (cid, p)

    @classmethod
    def empty(cls) -> CorpusPages:
        """No pages (the capture mode's: it serves nothing)."""
        self = cls.__new__(cls)
        self.store, self.pages = None, {}
        return self

    def __contains__(self, key: str) -> bool:
        return key in self.pages

    def prefix_hits(self, keys: list[str]) -> int:
        """How many leading keys are served (HiCache's ``batch_exists`` contract)."""
        for i, k in enumerate(keys):
            if k not in self.pages:
                return i
        return len(keys)

    def read(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, P, 576]`` latent (corpusd's layout) and ``[layers, P, 128]`` index keys of
        the page ``key`` names. Raises KeyError for a key not served."""
        cid, p = self.pages[key]
        assert self.store is not None, "an empty CorpusPages serves no key"
        m = self.store.manifest(cid)
        parts = [self.store.read_pages(cid, li, [p]) for li in range(m.n_layers)]
        return torch.cat([lat for lat, _ in parts]), torch.cat([idx for _, idx in parts])

    def engine_index_pages(self, key: str) -> list[torch.Tensor] | None:
        """Per layer, the indexer page an engine pin (``corpusd pin --engine``) captured, uint8
        ``[P·132]`` as SGLang held it; None for a corpus corpusd prefilled."""
        cid, p = self.pages[key]
        assert self.store is not None, "an empty CorpusPages serves no key"
        m = self.store.manifest(cid)
        parts = [self.store.read_index_pages(cid, li, [p]) for li in range(m.n_layers)]
        return None if any(x is None for x in parts) else [x[0] for x in parts if x is not None]

    def host_page(
        self, key: str, layout: str, dtype: torch.dtype, ue8m0: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The page as SGLang's host pool holds it: the flat KV data page
        (``set_from_flat_data_page``) and, per layer, the indexer page bytes: an engine pin's
        verbatim, else corpusd's keys quantised as SGLang would (:func:`.pagehash.index_k_page`)."""
        latent, keys = self.read(key)
        index = self.engine_index_pages(key)
        if index is None:
            index = [index_k_page(k, ue8m0) for k in keys]
        return host_kv_page(latent, layout, dtype), index


def engine_index_pages(store: PageStore, corpus_id: str, layer: int) -> torch.Tensor | None:
    """Every indexer page of ``layer`` of an engine pin in ``store`` (uint8 ``[n_pages,
    P·132]``, as SGLang computed them); None when the store does not have the corpus or it was
    prefilled by corpusd. The route paths score these instead of corpusd's float keys, whose fp8
    round trip is not the engine's bytes (NOTES.md, "Capture")."""
    if not store.has(corpus_id):
        return None
    m = store.manifest(corpus_id)
    return store.read_index_pages(corpus_id, layer, range(m.n_pages))


def engine_index_keys(store: PageStore, corpus_id: str, layer: int) -> torch.Tensor | None:
    """:func:`engine_index_pages` as the values SGLang's indexer scores: rotated, dequantised,
    float32 ``[T, 128]`` (:func:`.pagehash.index_k_from_page`); None as there."""
    pages = engine_index_pages(store, corpus_id, layer)
    if pages is None:
        return None
    p = store.manifest(corpus_id).page_size
    keys = torch.cat([index_k_from_page(page, p) for page in pages])
    return keys[: store.manifest(corpus_id).token_count]
