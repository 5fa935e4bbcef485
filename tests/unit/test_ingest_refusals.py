"""corpusd.corpus.ingest refuses, with a precise CorpusError: links out of the corpus root,
unsafe or special members, duplicate or non-UTF-8 names, sources that are not a corpus,
truncated or corrupt archives, and corpora with no text files."""

from __future__ import annotations

import gzip
import io
import os
import random
import re
import tarfile
from pathlib import Path

import pytest

from corpusd.corpus.ingest import CorpusError, ingest
from tests.support.tars import (
    KINDS,
    Member,
    materialize,
    random_text,
    tar_bytes,
    tar_entry,
    tar_file,
    write_dir,
    write_tar,
)

# --- links out of the root ------------------------------------------------------------------


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
    src = write_tar(tmp_path / "c.tar", [tar_file("a.txt", b"a"), tar_entry(name, type_, target)])
    with pytest.raises(CorpusError, match=f"'{name}' is a .*link to '{target}', outside the"):
        ingest(src)


@pytest.mark.parametrize("target", ["../outside.txt", "ABS", "../", "/"])
def test_dir_symlinks_escaping_root_are_rejected(tmp_path: Path, target: str) -> None:
    (tmp_path / "outside.txt").write_bytes(b"secret")
    root = write_dir(tmp_path / "c", {"a.txt": b"a"})
    os.symlink(str(tmp_path / "outside.txt") if target == "ABS" else target, root / "esc")
    with pytest.raises(CorpusError, match=r"'esc' is a symlink to .*, outside the corpus root"):
        ingest(root)


# --- unsafe or special members --------------------------------------------------------------


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
    src = write_tar(tmp_path / "c.tar", [tar_file("ok.txt", b"ok"), tar_file(name, b"evil")])
    with pytest.raises(CorpusError, match=_literal(message)):
        ingest(src)


def test_unsafe_directory_member_rejected(tmp_path: Path) -> None:
    src = write_tar(
        tmp_path / "c.tar", [tar_file("ok.txt", b"ok"), tar_entry("../d/", tarfile.DIRTYPE)]
    )
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
    src = write_tar(tmp_path / "c.tar", [tar_file("ok.txt", b"ok"), tar_entry("dev/x", type_)])
    with pytest.raises(CorpusError, match=f"corpus member 'dev/x' is {what}; only regular"):
        ingest(src)


def test_dir_fifo_rejected(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "c", {"a.txt": b"a"})
    (root / "sub").mkdir()
    os.mkfifo(root / "sub" / "pipe")
    with pytest.raises(CorpusError, match="corpus member 'sub/pipe' is a FIFO; only regular"):
        ingest(root)


@pytest.mark.parametrize("second", ["a.txt", "./a.txt", "a.txt/"])
def test_duplicate_tar_members_rejected(tmp_path: Path, second: str) -> None:
    src = write_tar(tmp_path / "c.tar", [tar_file("a.txt", b"one"), tar_file(second, b"two")])
    with pytest.raises(
        CorpusError, match=_literal("'a.txt' appears more than once in the archive")
    ):
        ingest(src)


def test_non_utf8_member_name_rejected(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as t:
        info, data = tar_file("caf\u00e9.txt", b"x")
        t.addfile(info, io.BytesIO(data))
    (tmp_path / "c.tar").write_bytes(buf.getvalue())
    with pytest.raises(CorpusError, match=r"'caf\\xe9.txt' has a name that is not valid UTF-8"):
        ingest(tmp_path / "c.tar")


# --- sources that are not a corpus ----------------------------------------------------------


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
        info, data = tar_file("a.txt", b"a")
        tar.addfile(info, io.BytesIO(data))
    (tmp_path / "c.tar.bz2").write_bytes(buf.getvalue())
    with pytest.raises(CorpusError, match=_literal("is bzip2-compressed; only tar and tar.gz")):
        ingest(tmp_path / "c.tar.bz2")


# --- truncated and corrupt archives ---------------------------------------------------------


def _big_members(seed: int) -> list[Member]:
    rng = random.Random(seed)
    return [tar_file(f"f{i}.txt", random_text(rng, 20_000)) for i in range(4)]


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9, -8, -4, -1])
def test_truncated_tgz_is_corrupt(tmp_path: Path, keep: float) -> None:
    whole = tar_bytes(_big_members(1), gz=True)
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
    whole = tar_bytes(members)
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
    src.write_bytes(tar_bytes([tar_file("a.txt", b"a")], gz=True) + b"junk" * 10)
    with pytest.raises(CorpusError, match="corrupt archive"):
        ingest(src)


def test_gzip_of_non_tar_is_corrupt(tmp_path: Path) -> None:
    src = tmp_path / "c.tar.gz"
    src.write_bytes(gzip.compress(b"hello, not a tar\n" * 100))
    with pytest.raises(CorpusError, match="corrupt archive"):
        ingest(src)


# --- empty corpora --------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_empty_tar_is_an_empty_corpus(tmp_path: Path, gz: bool) -> None:
    src = write_tar(tmp_path / "c.tar", [tar_entry("d/", tarfile.DIRTYPE)], gz=gz)
    with pytest.raises(CorpusError, match=_literal(f"corpus '{src}' has no files")):
        ingest(src)


def test_empty_directory_is_an_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "c" / "sub").mkdir(parents=True)
    with pytest.raises(CorpusError, match="has no files"):
        ingest(tmp_path / "c")


@pytest.mark.parametrize("kind", KINDS)
def test_only_skipped_files_is_an_empty_corpus(tmp_path: Path, kind: str) -> None:
    files = {"a.bin": b"\x00\x01", "b.bin": b"\x7fELF\x00", "c.txt": b""}
    src = materialize(tmp_path, kind, files)
    with pytest.raises(
        CorpusError, match=r"has no text files: all 3 were skipped \(2 binary, 1 empty\)"
    ):
        ingest(src)


def _literal(text: str) -> str:
    """A ``pytest.raises(match=...)`` pattern that matches ``text`` literally."""
    return re.escape(text)
