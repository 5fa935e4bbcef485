"""Test helpers for the coordinator: synthetic corpora (no prefill) and holders started together."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from corpusd.corpus.manifest import Manifest, corpus_id
from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig, fingerprint
from holder.launch import HolderProcess
from tests.support.holders import start_holder


def synthetic_corpus(
    store: Path, model_dir: Path, tokens: int, seed: int = 0, name: str = ""
) -> str:
    """A corpus of ``tokens`` random tokens with random latent rows, committed to ``store`` like a
    real pin (same manifest, files and checksums) but without the prefill: placement and holders
    only read pages, and a few seconds of prefill per corpus would dominate these tests. ``name``
    defaults to ``synthetic-<tokens>-<seed>``."""
    cfg = ModelConfig.from_dir(model_dir)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 256, (tokens,), generator=g)
    fp = fingerprint(model_dir)
    cid = corpus_id(tuple(toks.tolist()), fp, 64, "float32")
    m = Manifest(
        corpus_id=cid, name=name or f"synthetic-{tokens}-{seed}", state="ready", source_kind="test",
        source_digest="sha256:" + "0" * 64, token_count=tokens, page_size=64,
        n_pages=-(-tokens // 64), n_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim,
        index_dim=cfg.index_head_dim, dtype="float32", model_fingerprint=fp, tokenizer="bytes",
    )  # fmt: skip
    ps = PageStore(store)
    if ps.has(cid):
        return cid
    with ps.writer(cid) as w:
        w.write_tokens(toks)
        for layer in range(cfg.num_hidden_layers):
            lat = torch.randn(tokens, cfg.kv_dim, generator=g)
            w.write_layer(layer, lat, torch.randn(tokens, cfg.index_head_dim, generator=g), 64)
        w.write_manifest(replace(m, checksums=dict(w.checksums)))
    return cid


def start_holders(
    store: Path, root: Path, model: Path, coordinator: str, n: int, *extra: str
) -> list[HolderProcess]:
    """``n`` holders ``root/h0…`` registering with ``coordinator``, started in parallel."""
    with ThreadPoolExecutor(n) as ex:
        return list(
            ex.map(
                lambda i: start_holder(
                    store, root / f"h{i}", model, "--coordinator", coordinator, *extra
                ),
                range(n),
            )
        )
