"""Tests for corpusd.corpus.ingest: the same corpus as a directory, a tar and a tar.gz."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

import pytest

from corpusd.corpus.ingest import CorpusError, Ingested, Skipped, SourceFile, ingest

KINDS = ("dir", "tar", "tar.gz")

# Keys are deliberately out of order, with case and '.'-vs-'/' collisions, to pin plain
# str sorting: "A.txt" < "a.txt" < "a/b/c.md" < "a/z.py" < "b.txt".
CORPUS: dict[str, bytes] = {
    "b.txt": b"bee\n",
    "a/z.py": b"print('z')\n",
    "a.txt": "h\u00e9llo \u2713\r\n".encode(),
    "a/b/c.md": b"# c\n",
    "A.txt": b"upper\n",
}


# --- builders -------------------------------------------------------------------------------


Member = tuple[tarfile.TarInfo, bytes | None]


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _entry(name: str, type_: bytes, linkname: str = "") -> Member:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    return info, None


def _tar_bytes(members: Iterable[Member], *, gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _write_tar(path: Path, members: Iterable[Member], *, gz: bool = False) -> Path:
    path.write_bytes(_tar_bytes(members, gz=gz))
    return path


def _write_dir(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _materialize(tmp_path: Path, kind: str, files: dict[str, bytes]) -> Path:
    """The same files as a directory, a tar (with './' prefixes) or a tar.gz, in ``tmp_path``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if kind == "dir":
        return _write_dir(tmp_path / "corpus", files)
    members = [_file(f"./{name}", data) for name, data in files.items()]
    suffix = ".tar.gz" if kind == "tar.gz" else ".tar"
    return _write_tar(tmp_path / f"corpus{suffix}", members, gz=kind == "tar.gz")


def _random_text(rng: random.Random, n: int) -> bytes:
    # Hex is text yet compresses poorly, so a cut in the gzip stream lands inside member data.
    return rng.randbytes(n // 2).hex().encode()


# --- agreement across kinds -----------------------------------------------------------------


def test_dir_tar_and_tgz_agree(tmp_path: Path) -> None:
    results: dict[str, Ingested] = {}
    for kind in KINDS:
        results[kind] = ingest(_materialize(tmp_path / kind.replace(".", "_"), kind, CORPUS))
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
    src = _write_tar(
        tmp_path / "c.tar",
        [
            _entry("./", tarfile.DIRTYPE),
            _entry("./d/", tarfile.DIRTYPE),
            _file("./d/./x.txt", b"x"),
            _file("././y.txt", b"y"),
            _file("z.txt", b"z"),
        ],
    )
    assert [f.path for f in ingest(src).files] == ["d/x.txt", "y.txt", "z.txt"]


def test_tar_members_sorted_regardless_of_archive_order(tmp_path: Path) -> None:
    names = ["z", "a/b", "a.b", "B", "a/a", "é", "10", "9"]
    src = _write_tar(tmp_path / "c.tar", [_file(n, n.encode()) for n in names])
    assert [f.path for f in ingest(src).files] == sorted(names)


def test_compression_detected_by_content_not_name(tmp_path: Path) -> None:
    plain = tmp_path / "plain.tgz"
    plain.write_bytes(_tar_bytes([_file("a.txt", b"a")]))
    packed = tmp_path / "packed.tar"
    packed.write_bytes(_tar_bytes([_file("a.txt", b"a")], gz=True))
    assert ingest(plain).source_kind == "tar"
    assert ingest(packed).source_kind == "tar.gz"


def test_accepts_str_and_pathlike(tmp_path: Path) -> None:
    src = _materialize(tmp_path, "tar", CORPUS)
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
    result = ingest(_materialize(tmp_path, kind, files), max_file_bytes=8193)
    assert [f.path for f in result.files] == ["big.txt", "late_nul.txt", "ok.txt"]
    result = ingest(_materialize(tmp_path / "again", kind, files), max_file_bytes=100)
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
    src = _write_tar(tmp_path / "c.tar", [_file("a.txt", b"a"), _file("big.txt", b"y" * 2_000_000)])
    (skip,) = ingest(src).skipped
    assert skip == Skipped("big.txt", "oversize", "2,000,000 bytes > limit 1,048,576")


@pytest.mark.parametrize("kind", KINDS)
def test_max_file_bytes_boundary(tmp_path: Path, kind: str) -> None:
    src = _materialize(tmp_path, kind, {"at.txt": b"a" * 10, "over.txt": b"b" * 11})
    result = ingest(src, max_file_bytes=10)
    assert [f.path for f in result.files] == ["at.txt"]
    assert [(s.path, s.reason) for s in result.skipped] == [("over.txt", "oversize")]


def test_oversize_member_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _write_tar(tmp_path / "c.tar", [_file("a.txt", b"a"), _file("big.txt", b"b" * 50)])
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
        ingest(_materialize(tmp_path, "dir", CORPUS), max_file_bytes=0)


# --- links ----------------------------------------------------------------------------------


def test_tar_links_inside_root_are_skipped(tmp_path: Path) -> None:
    src = _write_tar(
        tmp_path / "c.tar",
        [
            _file("a.txt", b"a"),
            _entry("sub/up.txt", tarfile.SYMTYPE, "../a.txt"),
            _entry("sub/dangling", tarfile.SYMTYPE, "nowhere"),
            _entry("self", tarfile.SYMTYPE, "."),
            _entry("sub/hard.txt", tarfile.LNKTYPE, "a.txt"),
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


@pytest.mark.parametrize(
    ("type_", "name", "target"),
    [
        (tarfile.SYMTYPE, "sub/esc", "../../etc/passwd"),
        (tarfile.SYMTYPE, "esc", ".."),
        (tarfile.SYMTYPE, "sub/esc", "x/../../../y"),
        (tarfile.SYMTYPE, "esc", "/etc/passwd"),
        # A hard link names a member from the root, so "../x" escapes even from "sub/".
        (tarfile.LNKTYPE, "sub/esc", "../x"),
        (tarfile.LNKTYPE, "esc", "/etc/passwd"),
    ],
)
def test_tar_links_escaping_root_are_rejected(
    tmp_path: Path, type_: bytes, name: str, target: str
) -> None:
    src = _write_tar(tmp_path / "c.tar", [_file("a.txt", b"a"), _entry(name, type_, target)])
    with pytest.raises(CorpusError, match=f"'{name}' is a .*link to '{target}', outside the"):
        ingest(src)


def test_dir_symlinks_inside_root_are_skipped(tmp_path: Path) -> None:
    root = _write_dir(tmp_path / "c", {"a.txt": b"a", "sub/b.txt": b"b"})
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


@pytest.mark.parametrize("target", ["../outside.txt", "ABS", "../", "/"])
def test_dir_symlinks_escaping_root_are_rejected(tmp_path: Path, target: str) -> None:
    (tmp_path / "outside.txt").write_bytes(b"secret")
    root = _write_dir(tmp_path / "c", {"a.txt": b"a"})
    os.symlink(str(tmp_path / "outside.txt") if target == "ABS" else target, root / "esc")
    with pytest.raises(CorpusError, match=r"'esc' is a symlink to .*, outside the corpus root"):
        ingest(root)


def test_dir_root_reached_through_a_symlink_is_fine(tmp_path: Path) -> None:
    root = _write_dir(tmp_path / "c", {"a.txt": b"a"})
    os.symlink("a.txt", root / "l")
    os.symlink(root, tmp_path / "alias")
    result = ingest(tmp_path / "alias")
    assert [f.path for f in result.files] == ["a.txt"]
    assert [s.path for s in result.skipped] == ["l"]


# --- rejections -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("/etc/passwd", "corpus member '/etc/passwd' is an absolute path; refusing to read it"),
        ("../etc/passwd", "corpus member '../etc/passwd' has a '..' component; refusing"),
        ("a/../../x", "corpus member 'a/../../x' has a '..' component"),
        # Harmless-looking '..' is refused too: no member name needs one.
        ("a/../b.txt", "corpus member 'a/../b.txt' has a '..' component"),
        ("a/..", "corpus member 'a/..' has a '..' component"),
    ],
)
def test_unsafe_member_paths_rejected(tmp_path: Path, name: str, message: str) -> None:
    src = _write_tar(tmp_path / "c.tar", [_file("ok.txt", b"ok"), _file(name, b"evil")])
    with pytest.raises(CorpusError, match=_literal(message)):
        ingest(src)


def test_unsafe_directory_member_rejected(tmp_path: Path) -> None:
    src = _write_tar(tmp_path / "c.tar", [_file("ok.txt", b"ok"), _entry("../d/", tarfile.DIRTYPE)])
    with pytest.raises(CorpusError, match=_literal("'../d' has a '..' component")):
        ingest(src)


@pytest.mark.parametrize(
    ("type_", "what"),
    [
        (tarfile.CHRTYPE, "a character device"),
        (tarfile.BLKTYPE, "a block device"),
        (tarfile.FIFOTYPE, "a FIFO"),
    ],
)
def test_tar_special_members_rejected(tmp_path: Path, type_: bytes, what: str) -> None:
    src = _write_tar(tmp_path / "c.tar", [_file("ok.txt", b"ok"), _entry("dev/x", type_)])
    with pytest.raises(CorpusError, match=f"corpus member 'dev/x' is {what}; only regular"):
        ingest(src)


def test_dir_fifo_rejected(tmp_path: Path) -> None:
    root = _write_dir(tmp_path / "c", {"a.txt": b"a"})
    (root / "sub").mkdir()
    os.mkfifo(root / "sub" / "pipe")
    with pytest.raises(CorpusError, match="corpus member 'sub/pipe' is a FIFO; only regular"):
        ingest(root)


@pytest.mark.parametrize("second", ["a.txt", "./a.txt", "a.txt/"])
def test_duplicate_tar_members_rejected(tmp_path: Path, second: str) -> None:
    src = _write_tar(tmp_path / "c.tar", [_file("a.txt", b"one"), _file(second, b"two")])
    with pytest.raises(
        CorpusError, match=_literal("'a.txt' appears more than once in the archive")
    ):
        ingest(src)


def test_non_utf8_member_name_rejected(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as t:
        info, data = _file("caf\u00e9.txt", b"x")
        t.addfile(info, io.BytesIO(data))
    (tmp_path / "c.tar").write_bytes(buf.getvalue())
    with pytest.raises(CorpusError, match=r"'caf\\xe9.txt' has a name that is not valid UTF-8"):
        ingest(tmp_path / "c.tar")


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=_literal(f"corpus source '{tmp_path}/nope' does not")):
        ingest(tmp_path / "nope")


def test_plain_text_file_is_not_an_archive(tmp_path: Path) -> None:
    src = tmp_path / "notes.txt"
    src.write_text("just some notes\n")
    with pytest.raises(CorpusError, match=_literal(f"corrupt archive '{src}' (or not a tar")):
        ingest(src)


def test_fifo_source_rejected(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CorpusError, match="is neither a directory nor a regular file"):
        ingest(tmp_path / "pipe")


@pytest.mark.parametrize("size", [0, 1, 600, 4096])
def test_garbage_bytes_are_corrupt(tmp_path: Path, size: int) -> None:
    src = tmp_path / "c.tar"
    src.write_bytes(random.Random(size).randbytes(size))
    with pytest.raises(CorpusError, match=_literal(f"corrupt archive '{src}'")):
        ingest(src)


def test_bzip2_archive_rejected_as_unsupported(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:bz2") as tar:
        info, data = _file("a.txt", b"a")
        tar.addfile(info, io.BytesIO(data))
    (tmp_path / "c.tar.bz2").write_bytes(buf.getvalue())
    with pytest.raises(CorpusError, match=_literal("is bzip2-compressed; only tar and tar.gz")):
        ingest(tmp_path / "c.tar.bz2")


def _big_members(seed: int) -> list[Member]:
    rng = random.Random(seed)
    return [_file(f"f{i}.txt", _random_text(rng, 20_000)) for i in range(4)]


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9, -8, -4, -1])
def test_truncated_tgz_is_corrupt(tmp_path: Path, keep: float) -> None:
    whole = _tar_bytes(_big_members(1), gz=True)
    cut = int(len(whole) * keep) if keep > 0 else len(whole) + int(keep)
    src = tmp_path / "c.tar.gz"
    src.write_bytes(whole[:cut])
    with pytest.raises(CorpusError, match=_literal(f"corrupt archive '{src}': ")):
        ingest(src)


@pytest.mark.parametrize(
    "cut",
    [
        "mid_data",  # inside a member that is read
        "mid_skipped_data",  # inside a member that is skipped as oversize, so never read
        "member_boundary",  # exactly after a member: tarfile alone would just stop
        "mid_header",
    ],
)
def test_truncated_tar_is_corrupt(tmp_path: Path, cut: str) -> None:
    members = _big_members(2)
    whole = _tar_bytes(members)
    record = 512 + 20_000 + (-20_000 % 512)  # header + data padded to whole blocks
    at = {
        "mid_data": record + 512 + 1000,
        "mid_skipped_data": record + 512 + 1000,
        "member_boundary": 2 * record,
        "mid_header": 2 * record + 100,
    }[cut]
    src = tmp_path / "c.tar"
    src.write_bytes(whole[:at])
    limit = 100 if cut == "mid_skipped_data" else 1 << 20
    with pytest.raises(CorpusError, match=_literal(f"corrupt archive '{src}' (or not a tar")):
        ingest(src, max_file_bytes=limit)


def test_trailing_garbage_after_gzip_stream_is_corrupt(tmp_path: Path) -> None:
    src = tmp_path / "c.tar.gz"
    src.write_bytes(_tar_bytes([_file("a.txt", b"a")], gz=True) + b"junk" * 10)
    with pytest.raises(CorpusError, match="corrupt archive"):
        ingest(src)


def test_gzip_of_non_tar_is_corrupt(tmp_path: Path) -> None:
    src = tmp_path / "c.tar.gz"
    src.write_bytes(gzip.compress(b"hello, not a tar\n" * 100))
    with pytest.raises(CorpusError, match="corrupt archive"):
        ingest(src)


@pytest.mark.parametrize("gz", [False, True])
def test_empty_tar_is_an_empty_corpus(tmp_path: Path, gz: bool) -> None:
    src = _write_tar(tmp_path / "c.tar", [_entry("d/", tarfile.DIRTYPE)], gz=gz)
    with pytest.raises(CorpusError, match=_literal(f"corpus '{src}' has no files")):
        ingest(src)


def test_empty_directory_is_an_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "c" / "sub").mkdir(parents=True)
    with pytest.raises(CorpusError, match="has no files"):
        ingest(tmp_path / "c")


@pytest.mark.parametrize("kind", KINDS)
def test_only_skipped_files_is_an_empty_corpus(tmp_path: Path, kind: str) -> None:
    files = {"a.bin": b"\x00\x01", "b.bin": b"\x7fELF\x00", "c.txt": b""}
    src = _materialize(tmp_path, kind, files)
    with pytest.raises(
        CorpusError, match=r"has no text files: all 3 were skipped \(2 binary, 1 empty\)"
    ):
        ingest(src)


# --- digest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_digest_stable_and_content_sensitive(tmp_path: Path, kind: str) -> None:
    src = _materialize(tmp_path / "one", kind, CORPUS)
    digest = ingest(src).source_digest
    assert ingest(src).source_digest == digest

    edited = dict(CORPUS, **{"b.txt": b"bee!\n"})
    assert ingest(_materialize(tmp_path / "two", kind, edited)).source_digest != digest
    if kind != "dir":
        assert digest == "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()


def test_dir_digest_is_independent_of_location_and_sensitive_to_names(tmp_path: Path) -> None:
    a = ingest(_write_dir(tmp_path / "a", CORPUS)).source_digest
    b = ingest(_write_dir(tmp_path / "b", CORPUS)).source_digest
    assert a == b
    moved = {("renamed.txt" if k == "b.txt" else k): v for k, v in CORPUS.items()}
    assert ingest(_write_dir(tmp_path / "c", moved)).source_digest != a


def test_dir_digest_covers_skipped_files(tmp_path: Path) -> None:
    root = _write_dir(tmp_path / "c", {"a.txt": b"a", "big.txt": b"x" * 50, "e.txt": b""})
    digest = ingest(root, max_file_bytes=10).source_digest
    (root / "big.txt").write_bytes(b"y" * 50)
    assert ingest(root, max_file_bytes=10).source_digest != digest
    (root / "e.txt").unlink()
    assert ingest(root, max_file_bytes=10).source_digest != digest


def _literal(text: str) -> str:
    """A ``pytest.raises(match=...)`` pattern that matches ``text`` literally."""
    return re.escape(text)
