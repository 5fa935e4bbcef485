"""Page integrity: pin records a digest per page; every load checks the pages it reads, and a
corrupt page is refused (DATA_LOSS) before any frame is taken."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import grpc
import pytest
import torch

from corpusd.corpus.manifest import Manifest
from corpusd.corpus.store import MANIFEST, CorruptPages, PageStore, StoreError, layer_file
from corpusd.rpc import Reject
from holder.loading import Corrupt, load_pages
from holder.pool import FramePool, Geometry
from tests.support.corrupt import flip_byte, flip_page

P, KV, IDX, LAYERS, TOKENS = 4, 8, 3, 2, 10  # 3 pages, the last one half full
FP = "fingerprint"


def _store(tmp: Path, seed: int = 0, cid: str = "c0ffee") -> tuple[PageStore, Manifest]:
    g = torch.Generator().manual_seed(seed)
    m = Manifest(
        corpus_id=cid, name=f"c{seed}", state="ready", source_kind="test", source_digest="-",
        token_count=TOKENS, page_size=P, n_pages=3, n_layers=LAYERS, kv_dim=KV, index_dim=IDX,
        dtype="float32", model_fingerprint=FP, tokenizer="bytes",
    )  # fmt: skip
    store = PageStore(tmp / "store")
    with store.writer(cid) as w:
        w.write_tokens(torch.arange(TOKENS))
        for layer in range(LAYERS):
            w.write_layer(
                layer,
                torch.randn(TOKENS, KV, generator=g),
                torch.randn(TOKENS, IDX, generator=g),
                P,
            )
        m = w.write_manifest(m)
    return store, m


def _pool() -> FramePool:
    return FramePool(
        Geometry(LAYERS, P, kv_dim=KV, d_v=6, index_dim=IDX, dtype=torch.float32, frames=8)
    )


def test_pin_records_one_digest_per_page_and_intact_pages_read_back(tmp_path: Path) -> None:
    store, m = _store(tmp_path)
    assert len(m.page_digests) == 3 and len(set(m.page_digests)) == 3
    assert store.manifest(m.corpus_id) == m  # the digests survive the JSON round trip
    latent, keys = store.read_checked(m, [2, 0])
    for layer in range(LAYERS):
        lat, idx = store.read_pages(m.corpus_id, layer, [2, 0])
        assert torch.equal(latent[layer], lat) and torch.equal(keys[layer], idx)


@pytest.mark.parametrize(
    ("layer", "page", "tensor"), [(0, 0, "latent"), (1, 2, "index_keys"), (1, 1, "latent")]
)
def test_a_flipped_byte_is_named_by_page_and_only_loads_of_that_page_fail(
    tmp_path: Path, layer: int, page: int, tensor: str
) -> None:
    store, m = _store(tmp_path)
    flip_page(store.root, m.corpus_id, layer, page, tensor)
    with pytest.raises(CorruptPages, match=rf"1 of 3 pages fail their digest \(pages \[{page}\]\)"):
        store.read_checked(m, [0, 1, 2])
    try:
        store.read_checked(m, [0, 1, 2])
    except CorruptPages as e:
        assert e.pages == [page]
    others = [p for p in range(3) if p != page]
    store.read_checked(m, others)  # the intact pages still load
    flip_page(store.root, m.corpus_id, layer, page, tensor)  # restored: it loads again
    store.read_checked(m, [0, 1, 2])


def test_unreadable_files_and_manifests_are_corrupt_not_crashes(tmp_path: Path) -> None:
    store, m = _store(tmp_path)
    d = store.corpora / m.corpus_id
    flip_byte(d / layer_file(1), 12)  # inside the safetensors JSON header
    with pytest.raises(CorruptPages, match=r"layer_001\.safetensors cannot be read"):
        store.read_checked(m, [0])
    flip_byte(d / layer_file(1), 12)
    raw = (d / layer_file(0)).read_bytes()
    (d / layer_file(0)).write_bytes(raw[: len(raw) - 7])  # truncated
    with pytest.raises(CorruptPages, match=r"layer_000\.safetensors cannot be read"):
        store.read_checked(m, [2])
    (d / layer_file(0)).write_bytes(raw)
    store.read_checked(m, [2])
    for text, says in [
        ("{", "not JSON"),
        ("[]", "not an object"),
        (m.to_json().replace('"n_pages": 3', '"n_pages": "3"'), "'n_pages' is '3'"),
        (m.to_json().replace('"replicas": 1', '"replicas": true'), "'replicas' is True"),
        (m.to_json().replace('"n_pages": 3', '"n_pages": 4'), "n_pages"),
        (m.to_json()[:-1] + ', "extra": 1}', re.escape("unknown fields ['extra']")),
    ]:
        with pytest.raises(ValueError, match=says):
            Manifest.from_json(text)
        (d / MANIFEST).write_text(text)
        with pytest.raises(CorruptPages, match=says):
            store.manifest(m.corpus_id)
    (d / MANIFEST).write_text(m.to_json().replace(m.corpus_id, "beef"))
    with pytest.raises(CorruptPages, match="names corpus beef"):
        store.manifest(m.corpus_id)


def test_a_store_pinned_before_page_digests_is_checked_by_whole_file_checksums(
    tmp_path: Path,
) -> None:
    store, m = _store(tmp_path)
    old = json.loads(m.to_json())
    del old["page_digests"]  # written by a corpusd that had none
    (store.corpora / m.corpus_id / MANIFEST).write_text(json.dumps(old))
    legacy = store.manifest(m.corpus_id)
    assert legacy.page_digests == () and legacy.checksums == m.checksums
    store.read_checked(legacy, [0])
    flip_page(store.root, m.corpus_id, 1, 2)
    with pytest.raises(
        CorruptPages, match=r"layer_001\.safetensors is missing or fails its checksum"
    ):
        store.read_checked(legacy, [0])  # the whole file is refused: no per-page digests
    with pytest.raises(StoreError, match="pin it again"):
        store.read_checked(dataclasses.replace(legacy, checksums={}), [0])


def _state(pool: FramePool) -> tuple[object, ...]:
    return (
        pool.free_frames,
        {c: dict(h.pages) for c, h in pool.corpora.items()},
        dict(pool.table),
        pool.owner.clone(),
        pool.valid.clone(),
        [t.clone() for t in pool.latent],
    )


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    def eq(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, list):
            return isinstance(y, list) and all(eq(i, j) for i, j in zip(x, y, strict=True))
        return x == y

    return all(eq(x, y) for x, y in zip(a, b, strict=True))


def test_a_load_with_a_corrupt_page_is_refused_with_data_loss_and_changes_nothing(
    tmp_path: Path,
) -> None:
    store, m = _store(tmp_path)
    other, _ = _store(tmp_path, seed=1, cid="beef00")
    pool = _pool()
    held, loaded = load_pages(pool, store, FP, m.corpus_id, [0])
    assert loaded and list(held) == [0]
    load_pages(pool, other, FP, "beef00", [])
    before = _state(pool)
    flip_page(store.root, m.corpus_id, 1, 2, "index_keys")
    with pytest.raises(Corrupt) as info:
        load_pages(pool, store, FP, m.corpus_id, [0, 1, 2])
    assert info.value.code == grpc.StatusCode.DATA_LOSS and info.value.pages == [2]
    assert f"corpus {m.corpus_id}: 1 of 2 pages fail their digest (pages [2])" in str(info.value)
    assert _same(before, _state(pool))  # no frame taken, the held page untouched
    pool.check_integrity()
    assert load_pages(pool, store, FP, m.corpus_id, [0, 1]) == ({0: 0, 1: 4}, True)
    (store.corpora / m.corpus_id / MANIFEST).write_text("{")
    with pytest.raises(Corrupt, match=r"manifest\.json is unreadable") as info:
        load_pages(pool, store, FP, m.corpus_id, [2])
    assert info.value.code == grpc.StatusCode.DATA_LOSS and info.value.pages == []
    with pytest.raises(Reject) as nf:
        load_pages(pool, store, FP, "0" * 32, [])
    assert nf.value.code == grpc.StatusCode.NOT_FOUND
