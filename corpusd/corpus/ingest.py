"""Corpus ingest: turn a tar, tar.gz or directory into an ordered, validated set of text files.

This module owns reading a corpus source into memory and deciding, file by file, what is text.
It never extracts to disk, never follows a link, and does no tokenization: a caller turns
``Ingested.files`` into tokens and applies any token limit.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tarfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

__all__ = ["CorpusError", "Ingested", "SkipReason", "Skipped", "SourceFile", "ingest"]

SkipReason = Literal["binary", "oversize", "link", "empty", "not utf-8"]
SourceKind = Literal["tar", "tar.gz", "dir"]

_BINARY_SNIFF_BYTES = 8192
_TAR_BLOCK = 512
_CHUNK = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"
# Compressions tarfile could read but that have no SourceKind; sniffed to say so plainly.
_UNSUPPORTED_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


class CorpusError(ValueError):
    """Bad corpus input; the message is one precise line meant for the user."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One text file of the corpus.

    ``path`` is POSIX and relative to the corpus root (``"src/main.py"``: no leading ``./``,
    no ``.`` or ``..`` components); ``text`` is the file's content decoded as strict UTF-8,
    byte for byte (no newline or BOM normalization).
    """

    path: str
    text: str


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file left out of the corpus on purpose; ``detail`` is human text for a report."""

    path: str
    reason: SkipReason
    detail: str


@dataclass(frozen=True, slots=True)
class Ingested:
    """The result of :func:`ingest`.

    ``files`` and ``skipped`` are sorted by path (plain ``str`` order). ``source_digest`` is
    ``"sha256:<hex>"``: for an archive, of the archive file's bytes; for a directory, of every
    regular file (skipped ones included) as length-prefixed (path, content) records in path
    order, so renaming, editing, adding or removing a file changes it.
    """

    files: tuple[SourceFile, ...]
    skipped: tuple[Skipped, ...]
    source_digest: str
    source_kind: SourceKind


def ingest(source: str | os.PathLike[str], *, max_file_bytes: int = 1 << 20) -> Ingested:
    """Read the corpus at ``source`` (a ``.tar``, a gzip-compressed tar, or a directory).

    The archive's compression is detected from its content, not its name. Regular files become
    :class:`SourceFile`; these are skipped and reported, not errors: empty files, files over
    ``max_file_bytes`` (decided from the header/stat size before reading, so memory per file
    stays bounded by the limit), binary files (a NUL byte in the first 8192 bytes), files that
    are not valid UTF-8, and symlinks/hard links whose target stays inside the root (the target
    is read under its own path). A directory's hard links cannot be told apart from regular
    files and are read as such.

    Raises:
        CorpusError: ``source`` is missing, unreadable, or neither a directory nor a tar/tar.gz;
            the archive is corrupt or truncated (including a missing end-of-archive marker);
            a member path is absolute, has a ``..`` component, or is not valid UTF-8; a path
            appears twice in an archive; a link's target escapes the root (tar symlinks
            resolve from the link's directory, tar hard links from the root, absolute targets
            always escape; directory symlinks by ``os.path.realpath``); a member is a device,
            FIFO or socket; or no text file is left after skipping.
        ValueError: ``max_file_bytes`` is less than 1.
    """
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be >= 1, got {max_file_bytes=}")
    path = os.fspath(source)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CorpusError(f"corpus source '{path}' does not exist") from None
    except OSError as e:
        raise CorpusError(f"cannot read corpus source '{path}': {e.strerror}") from None

    if stat.S_ISDIR(mode):
        kind: SourceKind = "dir"
        files, skipped, digest = _ingest_dir(path, max_file_bytes)
    elif stat.S_ISREG(mode):
        kind, files, skipped, digest = _ingest_archive(path, max_file_bytes)
    else:
        raise CorpusError(f"corpus source '{path}' is neither a directory nor a regular file")

    if not files:
        raise CorpusError(_empty_corpus_message(path, skipped))
    return Ingested(
        files=tuple(sorted(files, key=lambda f: f.path)),
        skipped=tuple(sorted(skipped, key=lambda s: s.path)),
        source_digest=f"sha256:{digest}",
        source_kind=kind,
    )


# --- archives -----------------------------------------------------------------------------


def _ingest_archive(
    path: str, limit: int
) -> tuple[SourceKind, list[SourceFile], list[Skipped], str]:
    try:
        with open(path, "rb") as raw:
            digest = _sha256_stream(raw)
            raw.seek(0)
            magic = raw.read(8)
            raw.seek(0)
            kind = _archive_kind(path, magic)
            # The mode comes from the sniffed magic rather than "r:*": "r:*" would also accept
            # bzip2/xz and, on failure, reports every method it tried instead of the one cause.
            try:
                with tarfile.open(fileobj=raw, mode="r:gz" if kind == "tar.gz" else "r:") as tar:
                    files, skipped = _read_members(tar, limit)
                    _check_archive_end(tar, compressed=kind == "tar.gz")
            except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
                hint = "" if kind == "tar.gz" else " (or not a tar archive)"
                raise CorpusError(f"corrupt archive '{path}'{hint}: {_one_line(e)}") from None
    except OSError as e:
        raise CorpusError(f"cannot read corpus source '{path}': {e.strerror}") from None
    return kind, files, skipped, digest


def _archive_kind(path: str, magic: bytes) -> SourceKind:
    if magic.startswith(_GZIP_MAGIC):
        return "tar.gz"
    for prefix, name in _UNSUPPORTED_MAGIC.items():
        if magic.startswith(prefix):
            raise CorpusError(
                f"corpus archive '{path}' is {name}-compressed; only tar and tar.gz are supported"
            )
    return "tar"


def _read_members(tar: tarfile.TarFile, limit: int) -> tuple[list[SourceFile], list[Skipped]]:
    files: list[SourceFile] = []
    skipped: list[Skipped] = []
    seen: set[str] = set()
    for member in tar:
        name = _member_path(member.name)
        if member.isdir():
            continue
        if not name:
            raise CorpusError(
                f"corpus member '{member.name}' names the root but is not a directory"
            )
        if name in seen:
            raise CorpusError(f"corpus member '{name}' appears more than once in the archive")
        seen.add(name)

        if member.issym() or member.islnk():
            symbolic = member.issym()
            target = _tar_link_target(name, member.linkname, symbolic=symbolic)
            what = "symlink" if symbolic else "hard link"
            skipped.append(Skipped(name, "link", f"{what} to '{target}'"))
        elif member.isreg():
            early = _skip_by_size(name, member.size, limit)
            if early is not None:
                skipped.append(early)
                continue
            stream = tar.extractfile(member)
            assert stream is not None, f"extractfile returned None for regular {name=}"
            _classify(name, stream.read(), files, skipped)
        else:
            raise CorpusError(f"corpus member '{name}' is {_tar_type_name(member)}; {_ONLY}")
    return files, skipped


def _check_archive_end(tar: tarfile.TarFile, *, compressed: bool) -> None:
    # tarfile stops quietly at a header it cannot read past offset 0, so an archive cut at a
    # block boundary would lose its tail unnoticed; demand the zero block that ends every
    # POSIX archive where tarfile stopped.
    stream = tar.fileobj
    stream.seek(tar.offset)
    if stream.read(_TAR_BLOCK) != bytes(_TAR_BLOCK):
        raise tarfile.ReadError(f"no end-of-archive marker at byte {tar.offset:,} (truncated?)")
    if compressed:
        # Reading the gzip stream to its end is what checks its CRC and length trailer.
        while stream.read(_CHUNK):
            pass


def _member_path(name: str) -> str:
    """Normalize an archive member name to the ``SourceFile.path`` form; reject unsafe ones."""
    _check_utf8_name(name)
    if name.startswith("/"):
        raise CorpusError(f"corpus member '{name}' is an absolute path; refusing to read it")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise CorpusError(f"corpus member '{name}' has a '..' component; refusing to read it")
    return "/".join(parts)


def _tar_link_target(name: str, linkname: str, *, symbolic: bool) -> str:
    # A symlink's target is relative to the directory holding it; a tar hard link names
    # another member, so it is relative to the archive root.
    what = "symlink" if symbolic else "hard link"
    base = posixpath.dirname(name) if symbolic else ""
    resolved = posixpath.normpath(posixpath.join(base, linkname))
    if linkname.startswith("/") or resolved == ".." or resolved.startswith("../"):
        raise CorpusError(
            f"corpus member '{name}' is a {what} to '{linkname}', outside the corpus root; "
            "refusing to read it"
        )
    return resolved


def _tar_type_name(member: tarfile.TarInfo) -> str:
    if member.ischr():
        return "a character device"
    if member.isblk():
        return "a block device"
    if member.isfifo():
        return "a FIFO"
    return f"of unsupported tar type {member.type!r}"


# --- directories --------------------------------------------------------------------------


def _ingest_dir(root: str, limit: int) -> tuple[list[SourceFile], list[Skipped], str]:
    regular, skipped = _walk(root)
    regular.sort()
    files: list[SourceFile] = []
    hasher = hashlib.sha256()
    for rel in regular:
        size, data = _read_regular(root, rel, limit, hasher)
        early = _skip_by_size(rel, size, limit)
        if early is not None:
            skipped.append(early)
        else:
            assert data is not None, f"{rel=} of {size=} within {limit=} was not kept"
            _classify(rel, data, files, skipped)
    return files, skipped, hasher.hexdigest()


def _walk(root: str) -> tuple[list[str], list[Skipped]]:
    """Relative paths of the regular files under ``root``, and its in-root symlinks as skips."""
    real_root = os.path.realpath(root)
    regular: list[str] = []
    skipped: list[Skipped] = []

    def fail(e: OSError) -> None:
        # os.walk's default is to ignore unreadable directories, which would drop files.
        raise CorpusError(f"cannot read directory '{e.filename}': {e.strerror}")

    for dirpath, dirnames, filenames in os.walk(root, onerror=fail, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for entry in sorted(dirnames + filenames):
            full = os.path.join(dirpath, entry)
            rel = entry if rel_dir == "." else f"{rel_dir}/{entry}"
            _check_utf8_name(rel)
            try:
                mode = os.lstat(full).st_mode
            except OSError as e:
                raise CorpusError(f"cannot read corpus member '{rel}': {e.strerror}") from None
            if stat.S_ISLNK(mode):
                real = os.path.realpath(full)
                if os.path.commonpath([real_root, real]) != real_root:
                    raise CorpusError(
                        f"corpus member '{rel}' is a symlink to '{os.readlink(full)}', outside "
                        "the corpus root; refusing to read it"
                    )
                target = Path(os.path.relpath(real, real_root)).as_posix()
                skipped.append(Skipped(rel, "link", f"symlink to '{target}'"))
            elif stat.S_ISREG(mode):
                regular.append(rel)
            elif not stat.S_ISDIR(mode):
                raise CorpusError(f"corpus member '{rel}' is {_mode_name(mode)}; {_ONLY}")
    return regular, skipped


def _read_regular(
    root: str, rel: str, limit: int, hasher: hashlib._Hash
) -> tuple[int, bytes | None]:
    """Feed ``rel``'s record to ``hasher``; return its size and bytes (None if empty/oversize).

    An oversize file is hashed in chunks and never held whole in memory.
    """
    full = os.path.join(root, rel)
    # O_NOFOLLOW and the fstat re-check close the gap between the walk's lstat and this open
    # (a swapped-in symlink or FIFO); O_NONBLOCK keeps a swapped-in FIFO from blocking open.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(full, flags)
    except OSError as e:
        raise CorpusError(f"cannot read corpus member '{rel}': {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorpusError(f"corpus member '{rel}' changed while being read; try again")
        encoded = rel.encode()
        hasher.update(len(encoded).to_bytes(8, "big") + encoded + st.st_size.to_bytes(8, "big"))
        keep = 0 < st.st_size <= limit
        chunks: list[bytes] = []
        total = 0
        try:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
                total += len(chunk)
                if keep and total <= limit:
                    chunks.append(chunk)
        except OSError as e:
            raise CorpusError(f"cannot read corpus member '{rel}': {e.strerror}") from None
    if total != st.st_size:
        raise CorpusError(f"corpus member '{rel}' changed while being read; try again")
    return total, b"".join(chunks) if keep else None


def _mode_name(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return f"a special file (mode {oct(mode)})"


# --- shared -------------------------------------------------------------------------------

_ONLY = "only regular files, directories and links are allowed"


def _check_utf8_name(name: str) -> None:
    # Undecodable name bytes arrive as lone surrogates (surrogateescape); they would not
    # survive being sent or stored as a str path downstream.
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise CorpusError(f"corpus member '{shown}' has a name that is not valid UTF-8") from None


def _skip_by_size(path: str, size: int, limit: int) -> Skipped | None:
    if size == 0:
        return Skipped(path, "empty", "0 bytes")
    if size > limit:
        return Skipped(path, "oversize", f"{size:,} bytes > limit {limit:,}")
    return None


def _classify(path: str, data: bytes, files: list[SourceFile], skipped: list[Skipped]) -> None:
    nul = data.find(0, 0, _BINARY_SNIFF_BYTES)
    if nul >= 0:
        skipped.append(Skipped(path, "binary", f"NUL byte at offset {nul:,}"))
        return
    try:
        files.append(SourceFile(path, data.decode("utf-8")))
    except UnicodeDecodeError as e:
        skipped.append(Skipped(path, "not utf-8", f"invalid UTF-8 at byte {e.start:,}: {e.reason}"))


def _empty_corpus_message(source: str, skipped: list[Skipped]) -> str:
    if not skipped:
        return f"corpus '{source}' has no files"
    counts = Counter(s.reason for s in skipped)
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    return f"corpus '{source}' has no text files: all {len(skipped)} were skipped ({why})"


def _sha256_stream(stream: IO[bytes]) -> str:
    hasher = hashlib.sha256()
    while chunk := stream.read(_CHUNK):
        hasher.update(chunk)
    return hasher.hexdigest()


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {' '.join(str(e).split()) or 'no detail'}"
    # tarfile rewraps gzip's own errors as a bare "not a gzip file"; keep the real cause.
    return text if e.__cause__ is None else f"{text} ({_one_line(e.__cause__)})"
