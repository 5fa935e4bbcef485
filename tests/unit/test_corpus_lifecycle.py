"""The pieces of ``ls``/``unpin``/``rm`` that need no process: deleting from the page store
(one rename, nothing half gone, a corrupt corpus too), and the ``ls`` table and ages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corpusd.coordinator.client import CorpusStatus
from corpusd.coordinator.status import age, as_json, render_corpora
from corpusd.corpus.store import PageStore, StoreError
from corpusd.testing.holders import synthetic_corpus


def test_delete_removes_one_corpus_whole_and_refuses_anything_else(
    tmp_path: Path, tiny_dir: Path
) -> None:
    root = tmp_path / "store"
    a = synthetic_corpus(root, tiny_dir, 130, seed=1)
    b = synthetic_corpus(root, tiny_dir, 70, seed=2)
    store = PageStore(root)
    files = {f.name: f.stat().st_size for f in (store.corpora / a).iterdir()}
    (store.corpora / a / "layer_000.safetensors").write_bytes(b"garbled")  # corrupt: still goes
    size = sum(files.values()) - files["layer_000.safetensors"] + len(b"garbled")
    assert store.delete(a) == size
    assert store.ids() == [b] and not (store.corpora / a).exists() and not any(store.tmp.iterdir())
    for bad in (a, "nosuch", "../store", "", b + "/manifest.json"):
        with pytest.raises(StoreError, match="is not in the store at"):
            store.delete(bad)
    assert store.ids() == [b] and store.manifest(b).token_count == 70


def _corpus(name: str, state: str, **kw: object) -> CorpusStatus:
    values: dict[str, object] = dict(
        corpus_id=(name * 32)[:32], name=name, state=state, tokens=12_313, pages=193,
        page_size=64, cp_degree=2, replicas=1, model_fingerprint="f" * 64,
        holder_ids=("holder-a", "holder-b"), expired_holders=(), queue_position=0,
        created_at="2026-11-24T03:00:00+00:00", state_age_s=75.0,
    )  # fmt: skip
    values.update(kw)
    return CorpusStatus(**values)  # type: ignore[arg-type]


def test_ls_table_and_json() -> None:
    corpora = [
        _corpus("repo", "ready", expired_holders=("holder-b",)),
        _corpus("big", "queued", queue_position=1, holder_ids=(), state_age_s=7200.5),
        _corpus("old", "stored", replicas=0, holder_ids=(), state_age_s=3 * 86400),
    ]
    lines = render_corpora(corpora).splitlines()
    assert lines[0].split() == ["NAME", "ID", "TOKENS", "REPLICAS", "HOLDERS", "STATE", "AGE"]
    assert lines[1].split() == [
        "repo", "repo" * 3, "12,313", "1", "holder-a,holder-b(expired)", "ready", "1", "min",
    ]  # fmt: skip
    assert lines[2].split()[3:] == ["1", "-", "queued#1", "2", "h"]
    assert lines[3].split()[3:] == ["-", "-", "stored", "3", "d"]
    starts = {line.index(c.corpus_id[:12]) for line, c in zip(lines[1:], corpora, strict=True)}
    assert starts == {lines[0].index("ID")}  # the columns line up
    assert [age(s) for s in (0, 59.9, 60, 3599, 3600, 86399, 86400, -1)] == [
        "0 s", "59 s", "1 min", "59 min", "1 h", "23 h", "1 d", "0 s",
    ]  # fmt: skip
    back = json.loads(as_json(corpora))
    assert back[0]["holder_ids"] == ["holder-a", "holder-b"] and back[1]["queue_position"] == 1
    assert set(back[0]) == set(CorpusStatus.__dataclass_fields__)
