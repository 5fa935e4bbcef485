"""The one rule that turns a corpus name, id or id prefix into a corpus (`corpusd.corpus.names`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from corpusd.corpus.names import (
    MIN_PREFIX,
    CorpusNameError,
    default_name,
    resolve_in,
    resolve_name,
)

A = "ab12cd34ef56" + "0" * 20
B = "ab12cd99" + "1" * 24


@dataclass(frozen=True, slots=True)
class C:
    corpus_id: str
    name: str
    state: str = "ready"


def _refused(name: str, corpora: list[C], reason: str, words: str) -> CorpusNameError:
    with pytest.raises(CorpusNameError, match=words) as e:
        resolve_name(name, corpora)
    assert e.value.reason == reason, e.value
    return e.value


def test_id_then_name_then_prefix() -> None:
    a, b = C(A, "repo"), C(B, A)  # b is *named* what a's id is: the exact id wins
    assert resolve_name(A, [b, a]) is a
    assert resolve_name("repo", [a, b]) is a
    assert resolve_name(A[:MIN_PREFIX], [a, C(B, "other")]) is a
    assert resolve_name(A[:10], [a, b]) is a
    assert MIN_PREFIX == 8


def test_a_short_prefix_is_refused_saying_how_long_one_must_be() -> None:
    a = C(A, "repo")
    e = _refused(A[:7], [a], "unknown", "unknown corpus 'ab12cd3'; pinned: repo")
    assert "at least 8 characters" in str(e) and e.hint
    e = _refused("nope", [a], "unknown", "unknown corpus 'nope'; pinned: repo")
    assert "at least" not in str(e) and e.known == "repo"


def test_ambiguous_names_and_prefixes() -> None:
    a, b = C(A, "repo"), C(B, "repo")
    _refused("repo", [a, b], "ambiguous", "corpus 'repo' is ambiguous: ab12cd34ef56, ab12cd991111")
    _refused("ab12cd", [a, b], "unknown", "at least 8")
    assert resolve_name("ab12cd34", [a, b]) is a  # 8 characters that tell them apart
    # Two with one name, one ready: the ready one (a re-pin of changed content still pinning).
    assert resolve_name("repo", [a, C(B, "repo", "pinning")]) is a
    _refused("repo", [C(A, "repo", "queued"), C(B, "repo", "pinning")], "ambiguous", "ambiguous")


def test_retired_corpora_are_ignored_and_others_must_be_ready() -> None:
    _refused("repo", [C(A, "repo", "retired")], "unknown", "pinned: none")
    assert resolve_name("repo", [C(B, "repo", "retired"), C(A, "repo")]).corpus_id == A
    e = _refused("repo", [C(A, "repo", "queued")], "not_ready", "is queued, not ready")
    assert (e.corpus_id, e.state) == (A, "queued")


def test_resolve_in_takes_any_state_and_searches_the_groups_in_turn() -> None:
    """``unpin`` looks among pinned corpora first, then retired; ``rm`` the other way round."""
    pinned, retired = C(A, "repo", "queued"), C(B, "repo", "retired")
    assert resolve_in("repo", [pinned], [retired]) is pinned  # not_ready is no refusal here
    assert resolve_in("repo", [retired], [pinned]) is retired
    assert resolve_in(B, [pinned], [retired]) is retired  # an exact id beats a name anywhere
    assert resolve_in(B[:MIN_PREFIX], [pinned], [retired]) is retired
    assert resolve_in(B[: MIN_PREFIX - 1], [pinned], [retired]) is None  # too short a prefix
    assert resolve_in("other", [pinned], [retired]) is None
    assert resolve_in("", [pinned], [retired]) is None
    assert resolve_in("repo", [], [C(A, "repo", "stored"), C(A, "repo", "ready")]).corpus_id == A
    with pytest.raises(
        CorpusNameError, match="corpus 'repo' is ambiguous: ab12cd34ef56, ab12cd99"
    ) as e:
        resolve_in("repo", [pinned, C(B, "repo", "ready")], [])
    assert e.value.reason == "ambiguous"
    x, y = C("ab12cd00" + "2" * 24, "x"), C("ab12cd00" + "3" * 24, "y")
    with pytest.raises(CorpusNameError, match="ambiguous"):  # a prefix both ids share
        resolve_in("ab12cd00", [x, y])


def test_a_default_name_keeps_the_version_and_drops_only_the_archive_suffix() -> None:
    """Issue 37: ``h11-0.14.0.tar`` was named ``h11-0`` (cut at the first dot), so two versions
    of one package collided."""
    assert default_name("/tmp/h11-0.14.0.tar") == "h11-0.14.0"
    assert default_name("h11-0.15.0.tar.gz") == "h11-0.15.0"
    assert default_name("pkg-1.2.tgz") == "pkg-1.2"
    assert default_name("src/my.lib/") == "my.lib"
    assert default_name("notes.v2.txt") == "notes.v2.txt"
    assert default_name(".tar") == ".tar"
