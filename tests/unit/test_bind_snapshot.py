"""The agent's coordinator snapshot (requester/bind_snapshot.py): what it writes reads back,
holders of corpora no longer listed are dropped, and a damaged or foreign file counts as none
(the agent then answers as without a snapshot), never as a corpus list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corpusd.coordinator.client import CorpusStatus
from requester import bind_snapshot
from requester.bind_snapshot import FILE, load, save


def corpus(cid: str, name: str) -> CorpusStatus:
    return CorpusStatus(
        cid, name, "ready", 300, 5, 64, 1, 1, "fp", ("h0",), (), 0, "2026-11-28T00:00:00"
    )


def test_it_reads_back_what_it_wrote(tmp_path: Path) -> None:
    a, b = corpus("a" * 64, "alpha"), corpus("b" * 64, "beta")
    save(tmp_path, [a, b], a.corpus_id, ["127.0.0.1:2", "127.0.0.1:1"])
    save(tmp_path, [a, b], b.corpus_id, ["127.0.0.1:3"])
    snap = load(tmp_path)
    assert snap is not None
    assert snap.corpora == (a, b)
    assert snap.addresses(a.corpus_id) == ("127.0.0.1:2", "127.0.0.1:1")
    assert snap.addresses(b.corpus_id) == ("127.0.0.1:3",)
    assert snap.addresses("c" * 64) == ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert [p.name for p in tmp_path.iterdir()] == [FILE], "no temporary file is left"


def test_holders_of_a_corpus_no_longer_listed_are_dropped(tmp_path: Path) -> None:
    a, b = corpus("a" * 64, "alpha"), corpus("b" * 64, "beta")
    save(tmp_path, [a, b], a.corpus_id, ["127.0.0.1:1"])
    save(tmp_path, [b], b.corpus_id, ["127.0.0.1:3"])  # alpha was unpinned meanwhile
    snap = load(tmp_path)
    assert snap is not None and snap.holders == {b.corpus_id: ("127.0.0.1:3",)}


@pytest.mark.parametrize(
    "text", ["{", "[]", json.dumps({"version": 99, "corpora": [], "holders": {}, "saved_at": 0})]
)
def test_a_damaged_snapshot_is_none(tmp_path: Path, text: str) -> None:
    (tmp_path / FILE).write_text(text)
    assert load(tmp_path) is None
    assert load(tmp_path / "absent") is None


def test_a_failed_write_keeps_the_old_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = corpus("a" * 64, "alpha")
    save(tmp_path, [a], a.corpus_id, ["127.0.0.1:1"])

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bind_snapshot.os, "replace", full)
    save(tmp_path, [a], a.corpus_id, ["127.0.0.1:9"])  # logged, not raised
    snap = load(tmp_path)
    assert snap is not None and snap.addresses(a.corpus_id) == ("127.0.0.1:1",)
    assert [p.name for p in tmp_path.iterdir()] == [FILE]
