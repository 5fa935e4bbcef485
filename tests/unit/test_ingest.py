"""corpusd.corpus.ingest reads a corpus: the same files as a directory, a tar and a tar.gz agree;
what it skips (binary, not UTF-8, empty, oversize, links inside the root) is reported with
its path; the source digest. What it refuses is in test_ingest_refusals.py."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest

from corpusd.corpus.ingest import Ingested, Skipped, SourceFile, ingest
from tests.support.tars import (
    KINDS,
    materialize,
    tar_bytes,
    tar_entry,
    tar_file,
    write_dir,
    write_tar,
)

# Keys are deliberately out of order, with case and '.'-vs-'/' collisions, to pin plain
# str sorting: "A.txt" < "a.txt" < "a/b/c.md" < "a/z.py" < "b.txt".
CORPUS: dict[str, bytes] = {
    "b.txt": b"bee\n",
    "a/z.py": b"print('z')\n",
    "a.txt": "h\u00e9llo \u2713\r\n".encode(),
    "a/b/c.md": b"# c\n",
    "A.txt": b"upper\n",
}


# --- agreement across kinds -----------------------------------------------------------------


def test_dir_tar_and_tgz_agree(tmp_path: Path) -> None:
    results: dict[str, Ingested] = {}
    for kind in KINDS:
        results[kind] = ingest(materialize(tmp_path / kind.replace(".", "_"), kind, CORPUS))
        assert results[kind].source_kind == kind

    expected = tuple(SourceFile(name, CORPUS[name].decode()) for name in sorted(CORPUS))
    assert [f.path for f in expected] == ["A.txt", "a.txt", "a/b/c.md", "a/z.py", "b.txt"]
    for kind, result in results.items():
        assert result.files == expected, kind
        assert result.skipped == (), kind
        assert result.source_digest.startswith("sha256:"), kind
    # CRLF and non-ASCII survive untouched.
    assert results["tar"].files[1].text == "h\u00e9llo \u2713\r\n"


def test_dot_slash_and_dot_components_are_stripped(tmp_path: Path) -> None:
    src = write_tar(
        tmp_path / "c.tar",
        [
            tar_entry("./", tarfile.DIRTYPE),
            tar_entry("./d/", tarfile.DIRTYPE),
            tar_file("./d/./x.txt", b"x"),
            tar_file("././y.txt", b"y"),
            tar_file("z.txt", b"z"),
        ],
    )
    assert [f.path for f in ingest(src).files] == ["d/x.txt", "y.txt", "z.txt"]


def test_tar_members_sorted_regardless_of_archive_order(tmp_path: Path) -> None:
    names = ["z", "a/b", "a.b", "B", "a/a", "é", "10", "9"]
    src = write_tar(tmp_path / "c.tar", [tar_file(n, n.encode()) for n in names])
    assert [f.path for f in ingest(src).files] == sorted(names)


def test_compression_detected_by_content_not_name(tmp_path: Path) -> None:
    plain = tmp_path / "plain.tgz"
    plain.write_bytes(tar_bytes([tar_file("a.txt", b"a")]))
    packed = tmp_path / "packed.tar"
    packed.write_bytes(tar_bytes([tar_file("a.txt", b"a")], gz=True))
    assert ingest(plain).source_kind == "tar"
    assert ingest(packed).source_kind == "tar.gz"


def test_accepts_str_and_pathlike(tmp_path: Path) -> None:
    src = materialize(tmp_path, "tar", CORPUS)
    assert ingest(str(src)) == ingest(src)


# --- skips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_skip_reason_reported_with_its_path(tmp_path: Path, kind: str) -> None:
    files = {
        "ok.txt": b"fine\n",
        "bin/blob.dat": b"abc\x00def",
        "latin1.txt": b"caf\xe9\n",
        "empty.txt": b"",
        "big.txt": b"x" * 101,
        # A NUL past the sniff window is not "binary"; the file is valid UTF-8, so it is text.
        "late_nul.txt": b"a" * 8192 + b"\x00",
    }
    result = ingest(materialize(tmp_path, kind, files), max_file_bytes=8193)
    assert [f.path for f in result.files] == ["big.txt", "late_nul.txt", "ok.txt"]
    result = ingest(materialize(tmp_path / "again", kind, files), max_file_bytes=100)
    assert [f.path for f in result.files] == ["ok.txt"]
    assert [(s.path, s.reason) for s in result.skipped] == [
        ("big.txt", "oversize"),
        ("bin/blob.dat", "binary"),
        ("empty.txt", "empty"),
        ("late_nul.txt", "oversize"),
        ("latin1.txt", "not utf-8"),
    ]
    details = {s.path: s.detail for s in result.skipped}
    assert details["big.txt"] == "101 bytes > limit 100"
    assert details["bin/blob.dat"] == "NUL byte at offset 3"
    assert details["latin1.txt"].startswith("invalid UTF-8 at byte 3")


def test_oversize_detail_uses_thousands_separators(tmp_path: Path) -> None:
    src = write_tar(
        tmp_path / "c.tar", [tar_file("a.txt", b"a"), tar_file("big.txt", b"y" * 2_000_000)]
    )
    (skip,) = ingest(src).skipped
    assert skip == Skipped("big.txt", "oversize", "2,000,000 bytes > limit 1,048,576")


@pytest.mark.parametrize("kind", KINDS)
def test_max_file_bytes_boundary(tmp_path: Path, kind: str) -> None:
    src = materialize(tmp_path, kind, {"at.txt": b"a" * 10, "over.txt": b"b" * 11})
    result = ingest(src, max_file_bytes=10)
    assert [f.path for f in result.files] == ["at.txt"]
    assert [(s.path, s.reason) for s in result.skipped] == [("over.txt", "oversize")]


def test_oversize_member_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tar(tmp_path / "c.tar", [tar_file("a.txt", b"a"), tar_file("big.txt", b"b" * 50)])
    read: list[str] = []
    original = tarfile.TarFile.extractfile

    def spy(self: tarfile.TarFile, member: str | tarfile.TarInfo) -> object:
        read.append(member if isinstance(member, str) else member.name)
        return original(self, member)

    monkeypatch.setattr(tarfile.TarFile, "extractfile", spy)
    ingest(src, max_file_bytes=10)
    assert read == ["a.txt"]


def test_max_file_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_file_bytes must be >= 1"):
        ingest(materialize(tmp_path, "dir", CORPUS), max_file_bytes=0)


# --- links inside the root: skipped, reported -----------------------------------------------


def test_tar_links_inside_root_are_skipped(tmp_path: Path) -> None:
    src = write_tar(
        tmp_path / "c.tar",
        [
            tar_file("a.txt", b"a"),
            tar_entry("sub/up.txt", tarfile.SYMTYPE, "../a.txt"),
            tar_entry("sub/dangling", tarfile.SYMTYPE, "nowhere"),
            tar_entry("self", tarfile.SYMTYPE, "."),
            tar_entry("sub/hard.txt", tarfile.LNKTYPE, "a.txt"),
        ],
    )
    result = ingest(src)
    assert [f.path for f in result.files] == ["a.txt"]
    assert result.skipped == (
        Skipped("self", "link", "symlink to '.'"),
        Skipped("sub/dangling", "link", "symlink to 'sub/nowhere'"),
        Skipped("sub/hard.txt", "link", "hard link to 'a.txt'"),
        Skipped("sub/up.txt", "link", "symlink to 'a.txt'"),
    )


def test_dir_symlinks_inside_root_are_skipped(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "c", {"a.txt": b"a", "sub/b.txt": b"b"})
    os.symlink("../a.txt", root / "sub" / "up.txt")
    os.symlink("sub", root / "dirlink")
    os.symlink(root / "a.txt", root / "absolute_inside")
    os.symlink("nowhere", root / "dangling")
    result = ingest(root)
    assert [f.path for f in result.files] == ["a.txt", "sub/b.txt"]
    assert [(s.path, s.reason) for s in result.skipped] == [
        ("absolute_inside", "link"),
        ("dangling", "link"),
        ("dirlink", "link"),
        ("sub/up.txt", "link"),
    ]
    details = {s.path: s.detail for s in result.skipped}
    # Details name the resolved, root-relative target, as they do for tar links.
    assert details["sub/up.txt"] == "symlink to 'a.txt'"
    assert details["dirlink"] == "symlink to 'sub'"
    assert details["absolute_inside"] == "symlink to 'a.txt'"


def test_dir_root_reached_through_a_symlink_is_fine(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "c", {"a.txt": b"a"})
    os.symlink("a.txt", root / "l")
    os.symlink(root, tmp_path / "alias")
    result = ingest(tmp_path / "alias")
    assert [f.path for f in result.files] == ["a.txt"]
    assert [s.path for s in result.skipped] == ["l"]


# --- digest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_digest_stable_and_content_sensitive(tmp_path: Path, kind: str) -> None:
    src = materialize(tmp_path / "one", kind, CORPUS)
    digest = ingest(src).source_digest
    assert ingest(src).source_digest == digest

    edited = dict(CORPUS, **{"b.txt": b"bee!\n"})
    assert ingest(materialize(tmp_path / "two", kind, edited)).source_digest != digest
    if kind != "dir":
        assert digest == "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()


def test_dir_digest_is_independent_of_location_and_sensitive_to_names(tmp_path: Path) -> None:
    a = ingest(write_dir(tmp_path / "a", CORPUS)).source_digest
    b = ingest(write_dir(tmp_path / "b", CORPUS)).source_digest
    assert a == b
    moved = {("renamed.txt" if k == "b.txt" else k): v for k, v in CORPUS.items()}
    assert ingest(write_dir(tmp_path / "c", moved)).source_digest != a


def test_dir_digest_covers_skipped_files(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "c", {"a.txt": b"a", "big.txt": b"x" * 50, "e.txt": b""})
    digest = ingest(root, max_file_bytes=10).source_digest
    (root / "big.txt").write_bytes(b"y" * 50)
    assert ingest(root, max_file_bytes=10).source_digest != digest
    (root / "e.txt").unlink()
    assert ingest(root, max_file_bytes=10).source_digest != digest
