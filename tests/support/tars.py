"""Corpus sources for tests that ingest them: the same files as a directory, a tar or a tar.gz,
and tar members of any type (links, devices, FIFOs, unsafe names) built in memory."""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Iterable
from pathlib import Path

KINDS = ("dir", "tar", "tar.gz")

Member = tuple[tarfile.TarInfo, bytes | None]


def tar_file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def tar_entry(name: str, type_: bytes, linkname: str = "") -> Member:
    """A member without data: a directory, link or device (``type_``: ``tarfile.DIRTYPE``, …)."""
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    return info, None


def tar_bytes(members: Iterable[Member], *, gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def write_tar(path: Path, members: Iterable[Member], *, gz: bool = False) -> Path:
    path.write_bytes(tar_bytes(members, gz=gz))
    return path


def write_dir(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def materialize(tmp_path: Path, kind: str, files: dict[str, bytes]) -> Path:
    """The same files as a directory, a tar (with './' prefixes) or a tar.gz, in ``tmp_path``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if kind == "dir":
        return write_dir(tmp_path / "corpus", files)
    members = [tar_file(f"./{name}", data) for name, data in files.items()]
    suffix = ".tar.gz" if kind == "tar.gz" else ".tar"
    return write_tar(tmp_path / f"corpus{suffix}", members, gz=kind == "tar.gz")


def random_text(rng: random.Random, n: int) -> bytes:
    # Hex is text yet compresses poorly, so a cut in the gzip stream lands inside member data.
    return rng.randbytes(n // 2).hex().encode()
