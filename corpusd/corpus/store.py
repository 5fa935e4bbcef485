"""The local page store: one directory per pinned corpus, committed atomically.

Layout under ``root``::

    corpora/<corpus_id>/manifest.json
    corpora/<corpus_id>/tokens.safetensors        "tokens" int32 [T]
    corpora/<corpus_id>/layer_000.safetensors     "latent" [n_pages, P, kv_dim],
                                                  "index_keys" [n_pages, P, index_dim]
    tmp/<corpus_id>.<pid>.<nonce>/                a corpus being written; never read

A corpus becomes visible only by the rename of its finished, fsynced temp directory, so a crash
mid-pin leaves nothing under ``corpora/``; stale temp directories of dead writers are removed when
a store is opened. Rows past ``token_count`` in the last page are zero and never referenced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from corpusd.corpus.manifest import Manifest
from corpusd.corpus.names import CorpusNameError, resolve_name

MANIFEST = "manifest.json"
TOKENS = "tokens.safetensors"


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


class StoreError(LookupError):
    """An unknown corpus, or a corpus directory that fails its checks; the message says which."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CorpusWriter:
    """Collects one corpus's files in a temp directory; ``PageStore.writer`` commits it."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.checksums: dict[str, str] = {}

    def _put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.dir / name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        _fsync(path)
        self.checksums[name] = _sha256_file(path)

    def write_tokens(self, tokens: torch.Tensor) -> None:
        self._put(TOKENS, {"tokens": tokens.to(torch.int32)})

    def write_layer(
        self, layer: int, latent: torch.Tensor, index_keys: torch.Tensor, page: int
    ) -> None:
        """``latent [T, kv_dim]``, ``index_keys [T, index_dim]`` → pages of ``page`` rows."""
        t = latent.shape[0]
        n_pages = -(-t // page)
        pad = n_pages * page - t
        lat = torch.nn.functional.pad(latent, (0, 0, 0, pad)).view(n_pages, page, -1)
        idx = torch.nn.functional.pad(index_keys, (0, 0, 0, pad)).view(n_pages, page, -1)
        self._put(layer_file(layer), {"latent": lat, "index_keys": idx})

    def write_manifest(self, manifest: Manifest) -> None:
        path = self.dir / MANIFEST
        path.write_text(manifest.to_json())
        _fsync(path)


class PageStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.corpora = self.root / "corpora"
        self.tmp = self.root / "tmp"
        self.corpora.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()

    def _remove_stale_temps(self) -> None:
        for d in self.tmp.iterdir():
            parts = d.name.split(".")
            if len(parts) == 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
                shutil.rmtree(d, ignore_errors=True)

    # -- reading ----------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return sorted(d.name for d in self.corpora.iterdir() if (d / MANIFEST).is_file())

    def has(self, corpus_id: str) -> bool:
        return (self.corpora / corpus_id / MANIFEST).is_file()

    def manifest(self, corpus_id: str) -> Manifest:
        path = self.corpora / corpus_id / MANIFEST
        if not path.is_file():
            raise StoreError(f"corpus {corpus_id!r} is not in the store at {self.root}")
        return Manifest.from_json(path.read_text())

    def resolve(self, name_or_id: str) -> str:
        """The id of the stored corpus ``name_or_id`` means (``resolve_name``: an id, a unique
        name, or a unique id prefix of ≥ 8 characters). Raises StoreError saying why not."""
        ids = self.ids()
        if name_or_id in ids:
            return name_or_id  # without reading every manifest
        try:
            return resolve_name(name_or_id, [self.manifest(i) for i in ids]).corpus_id
        except CorpusNameError as e:
            if e.reason != "unknown":
                raise StoreError(str(e)) from None
            hint = f" ({e.hint})" if e.hint else ""
            raise StoreError(
                f"no corpus named or with id {name_or_id!r} in {self.root}; stored: {e.known}{hint}"
            ) from None

    def read_tokens(self, corpus_id: str) -> torch.Tensor:
        with safe_open(str(self.corpora / corpus_id / TOKENS), framework="pt") as f:
            return f.get_tensor("tokens")

    def read_pages(
        self, corpus_id: str, layer: int, pages: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent ``[len(pages), P, kv_dim]`` and index keys ``[len(pages), P, index_dim]``.

        Reads only the requested pages (safetensors slices of the memory-mapped file).
        Raises StoreError for an unknown corpus, layer or page number.
        """
        m = self.manifest(corpus_id)
        if not 0 <= layer < m.n_layers:
            raise StoreError(f"corpus {corpus_id} has layers 0..{m.n_layers - 1}, not {layer}")
        bad = [p for p in pages if not 0 <= p < m.n_pages]
        if bad:
            raise StoreError(
                f"corpus {corpus_id} has pages 0..{m.n_pages - 1}; asked for {bad[:4]}"
            )
        with safe_open(str(self.corpora / corpus_id / layer_file(layer)), framework="pt") as f:
            lat, idx = f.get_slice("latent"), f.get_slice("index_keys")
            if not pages:
                return (
                    torch.empty(0, m.page_size, m.kv_dim, dtype=m.torch_dtype),
                    torch.empty(0, m.page_size, m.index_dim, dtype=m.torch_dtype),
                )
            return (
                torch.stack([lat[p : p + 1][0] for p in pages]),
                torch.stack([idx[p : p + 1][0] for p in pages]),
            )

    def verify(self, corpus_id: str) -> None:
        """Recompute every file's checksum; raises StoreError naming the first mismatch."""
        m = self.manifest(corpus_id)
        expected = {TOKENS, *(layer_file(i) for i in range(m.n_layers))}
        if set(m.checksums) != expected:
            raise StoreError(f"corpus {corpus_id}: manifest lists {sorted(m.checksums)}")
        for name, digest in sorted(m.checksums.items()):
            path = self.corpora / corpus_id / name
            if not path.is_file() or _sha256_file(path) != digest:
                raise StoreError(f"corpus {corpus_id}: {name} is missing or fails its checksum")

    # -- writing ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer(self, corpus_id: str) -> Iterator[CorpusWriter]:
        """Yield a writer on a fresh temp directory; on a clean exit rename it into place.

        The caller must have written the manifest last. If the corpus appeared meanwhile (another
        pin of the same content) the temp copy is dropped: same id, same content. On any
        exception the temp directory is removed and nothing becomes visible.
        """
        tmp = self.tmp / f"{corpus_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            w = CorpusWriter(tmp)
            yield w
            if not (tmp / MANIFEST).is_file():
                raise RuntimeError("corpus writer closed without a manifest")
            _fsync(tmp)
            final = self.corpora / corpus_id
            try:
                os.rename(tmp, final)
            except OSError:
                if not self.has(corpus_id):
                    raise
            _fsync(self.corpora)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
