"""The local page store: one directory per pinned corpus, committed atomically.

Layout under ``root``::

    corpora/<corpus_id>/manifest.json
    corpora/<corpus_id>/tokens.safetensors        "tokens" int32 [T]
    corpora/<corpus_id>/layer_000.safetensors     "latent" [n_pages, P, kv_dim] (fp8_e4m3
                                                  format: uint8 [n_pages, P, 656]),
                                                  "index_keys" [n_pages, P, index_dim];
                                                  engine pins also "index_pages" uint8
                                                  [n_pages, P·132]: the engine's indexer pages
                                                  verbatim (``corpusd/engine/spool.py``)
    tmp/<corpus_id>.<pid>.<nonce>/                a corpus being written; never read

Integrity: the manifest records a checksum per file and a digest per page (``page_digest``,
over the page's latent and index-key bytes in every layer), so a reader checks exactly the pages
it loads (``read_checked``); a corrupt or unreadable page raises ``CorruptPages`` naming them.

A corpus becomes visible only by the rename of its finished, fsynced temp directory, so a crash
mid-pin leaves nothing under ``corpora/``; stale temp directories of dead writers are removed when
a store is opened. Rows past ``token_count`` in the last page are zero and never referenced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import safe_open

from corpusd.corpus.manifest import Manifest
from corpusd.corpus.names import CorpusNameError, resolve_name

if TYPE_CHECKING:  # torch is imported where a tensor is read or written: the coordinator, which
    import torch  # only lists and names corpora, runs without it (docs/architecture.md)

MANIFEST = "manifest.json"
TOKENS = "tokens.safetensors"


ID_RULE = "1 to 64 letters and digits"
_ID = re.compile(r"[0-9A-Za-z]{1,64}")


def is_corpus_id(text: str) -> bool:
    """Whether ``text`` may name a corpus directory: pin's ids are 32 hex digits; anything with
    a path separator, a dot or of a length no file system takes is refused before it is a path."""
    return _ID.fullmatch(text) is not None


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


class StoreError(LookupError):
    """An unknown corpus, or a corpus directory that fails its checks; the message says which."""


class CorruptPages(StoreError):
    """Stored bytes that fail their digest or cannot be read. ``pages``: the corpus pages that
    failed (empty when a whole file or the manifest did)."""

    def __init__(self, message: str, pages: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.pages = list(pages)


def page_digest(latent: Sequence[torch.Tensor], index_keys: Sequence[torch.Tensor]) -> str:
    """Hex BLAKE2b-128 of one page: per layer in order, its latent ``[P, kv_dim]`` bytes then its
    index-key ``[P, index_dim]`` bytes, as stored (the dtype's little-endian bytes, padding rows
    included)."""
    h = hashlib.blake2b(digest_size=16)
    for lat, keys in zip(latent, index_keys, strict=True):
        h.update(_raw(lat))
        h.update(_raw(keys))
    return h.hexdigest()


def _raw(t: torch.Tensor) -> bytes:
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


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
        self._pages: list[hashlib.blake2b] = []  # one running page digest per page
        self._layers = 0

    def _put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.dir / name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        _fsync(path)
        self.checksums[name] = _sha256_file(path)

    def write_tokens(self, tokens: torch.Tensor) -> None:
        import torch

        self._put(TOKENS, {"tokens": tokens.to(torch.int32)})

    def write_layer(
        self,
        layer: int,
        latent: torch.Tensor,
        index_keys: torch.Tensor,
        page: int,
        index_pages: torch.Tensor | None = None,
    ) -> None:
        """``latent [T, kv_dim]``, ``index_keys [T, index_dim]`` → pages of ``page`` rows.
        Layers are written in order 0, 1, …: each page's digest runs over them in that order.
        ``index_pages`` (engine pins): uint8 ``[n_pages, ·]`` stored as is, covered by the
        file's checksum (not by the page digests)."""
        import torch

        assert layer == self._layers, (
            f"layers are written in order: {layer=}, expected {self._layers}"
        )
        t = latent.shape[0]
        n_pages = -(-t // page)
        pad = n_pages * page - t
        lat = torch.nn.functional.pad(latent, (0, 0, 0, pad)).view(n_pages, page, -1).contiguous()
        idx = torch.nn.functional.pad(index_keys, (0, 0, 0, pad)).view(n_pages, page, -1)
        idx = idx.contiguous()
        tensors = {"latent": lat, "index_keys": idx}
        if index_pages is not None:
            assert index_pages.dtype == torch.uint8 and index_pages.shape[0] == n_pages, (
                f"{index_pages.shape=} {index_pages.dtype=} for {n_pages=}"
            )
            tensors["index_pages"] = index_pages
        self._put(layer_file(layer), tensors)
        if not self._pages:
            self._pages = [hashlib.blake2b(digest_size=16) for _ in range(n_pages)]
        assert len(self._pages) == n_pages, (
            f"{n_pages=} in layer {layer}, {len(self._pages)} before"
        )
        for j, h in enumerate(self._pages):
            h.update(_raw(lat[j]))
            h.update(_raw(idx[j]))
        self._layers += 1

    def write_manifest(self, manifest: Manifest) -> Manifest:
        """Write ``manifest`` with the checksums and page digests of what was written; returns
        it as written."""
        manifest = replace(
            manifest,
            checksums=dict(self.checksums),
            page_digests=tuple(h.hexdigest() for h in self._pages),
        )
        path = self.dir / MANIFEST
        path.write_text(manifest.to_json())
        _fsync(path)
        return manifest


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
        return is_corpus_id(corpus_id) and (self.corpora / corpus_id / MANIFEST).is_file()

    def manifest(self, corpus_id: str) -> Manifest:
        """Raises StoreError (not a corpus id, or not stored) or CorruptPages (an unreadable
        manifest)."""
        if not is_corpus_id(corpus_id):
            raise StoreError(f"{corpus_id[:80]!r} is not a corpus id ({ID_RULE})")
        path = self.corpora / corpus_id / MANIFEST
        if not path.is_file():
            raise StoreError(f"corpus {corpus_id!r} is not in the store at {self.root}")
        try:
            m = Manifest.from_json(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CorruptPages(f"corpus {corpus_id}: {MANIFEST} is unreadable: {e}") from None
        if m.corpus_id != corpus_id:
            raise CorruptPages(f"corpus {corpus_id}: {MANIFEST} names corpus {m.corpus_id}")
        return m

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

    def read_token_ids(self, corpus_id: str) -> np.ndarray:
        """The corpus's token ids as numpy int32 ``[T]``: ``read_tokens`` without torch."""
        with safe_open(str(self.corpora / corpus_id / TOKENS), framework="np") as f:
            return f.get_tensor("tokens")

    def read_pages(
        self, corpus_id: str, layer: int, pages: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent ``[len(pages), P, kv_dim]`` (uint8 ``[len(pages), P, 656]`` for fp8 rows) and
        index keys ``[len(pages), P, index_dim]``, as stored.

        Reads only the requested pages (safetensors slices of the memory-mapped file), unchecked
        (``read_checked`` checks them). Raises StoreError for an unknown corpus, layer or page
        number.
        """
        m = self.manifest(corpus_id)
        if not 0 <= layer < m.n_layers:
            raise StoreError(f"corpus {corpus_id} has layers 0..{m.n_layers - 1}, not {layer}")
        self._check_range(m, pages)
        return self._read_layer(m, layer, pages)

    def read_index_pages(
        self, corpus_id: str, layer: int, pages: Sequence[int]
    ) -> torch.Tensor | None:
        """An engine pin's verbatim indexer pages, uint8 ``[len(pages), P·132]`` (unchecked, as
        ``read_pages``); None for a corpus that has none."""
        import torch

        m = self.manifest(corpus_id)
        self._check_range(m, pages)
        with safe_open(str(self.corpora / corpus_id / layer_file(layer)), framework="pt") as f:
            names = set(f.keys())
            if "index_pages" not in names:
                return None
            sl = f.get_slice("index_pages")
            return torch.stack([sl[p : p + 1][0] for p in pages])

    @staticmethod
    def _check_range(m: Manifest, pages: Sequence[int]) -> None:
        bad = [p for p in pages if not 0 <= p < m.n_pages]
        if bad:
            raise StoreError(
                f"corpus {m.corpus_id} has pages 0..{m.n_pages - 1}; asked for {bad[:4]}"
            )

    def _read_layer(
        self, m: Manifest, layer: int, pages: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        if not pages:
            return (
                torch.empty(0, m.page_size, m.latent_width, dtype=m.latent_dtype),
                torch.empty(0, m.page_size, m.index_dim, dtype=m.torch_dtype),
            )
        path = self.corpora / m.corpus_id / layer_file(layer)
        with safe_open(str(path), framework="pt") as f:
            lat, idx = f.get_slice("latent"), f.get_slice("index_keys")
            return (
                torch.stack([lat[p : p + 1][0] for p in pages]),
                torch.stack([idx[p : p + 1][0] for p in pages]),
            )

    def read_checked(
        self, m: Manifest, pages: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, latent ``[len(pages), P, kv_dim]`` and index keys ``[len(pages), P,
        index_dim]`` of corpus ``m``, every page checked against its digest in ``m`` (a corpus
        pinned before page digests: its layer files against their checksums, whole).

        Raises:
            CorruptPages: a page fails its digest (all such pages are named), or a layer file is
                missing, truncated, unreadable or of another shape than the manifest's.
            StoreError: a page number out of range, or a corpus with neither page digests nor
                checksums (pin it again).
        """
        cid = m.corpus_id
        self._check_range(m, pages)
        if not m.page_digests:
            if not m.checksums:
                raise StoreError(
                    f"corpus {cid} has no page digests or checksums to check its pages against "
                    "(pinned by an old corpusd): pin it again"
                )
            self.verify(cid, [layer_file(i) for i in range(m.n_layers)])
        latent: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        want = [
            ((len(pages), m.page_size, m.latent_width), m.latent_dtype),
            ((len(pages), m.page_size, m.index_dim), m.torch_dtype),
        ]
        for layer in range(m.n_layers):
            try:
                lat, idx = self._read_layer(m, layer, pages)
            except Exception as e:  # missing, truncated or garbled: the reader's own error
                raise CorruptPages(
                    f"corpus {cid}: {layer_file(layer)} cannot be read "
                    f"({type(e).__name__}: {e}); restore the store or pin the corpus again"
                ) from None
            got = [(tuple(lat.shape), lat.dtype), (tuple(idx.shape), idx.dtype)]
            if got != want:
                raise CorruptPages(
                    f"corpus {cid}: {layer_file(layer)} holds {got}, the manifest says {want}"
                )
            latent.append(lat)
            keys.append(idx)
        if m.page_digests:
            bad = [
                p
                for j, p in enumerate(pages)
                if page_digest([x[j] for x in latent], [x[j] for x in keys]) != m.page_digests[p]
            ]
            if bad:
                raise CorruptPages(
                    f"corpus {cid}: {len(bad)} of {len(pages)} pages fail their digest "
                    f"(pages {bad[:8]}{' …' if len(bad) > 8 else ''}): the page store under "
                    f"{self.corpora / cid} is corrupt; restore it or pin the corpus again",
                    bad,
                )
        return latent, keys

    def verify(self, corpus_id: str, names: Sequence[str] | None = None) -> None:
        """Recompute every file's checksum (the ``names`` given); raises CorruptPages naming the
        first mismatch, StoreError when the manifest does not list the corpus's files."""
        m = self.manifest(corpus_id)
        expected = {TOKENS, *(layer_file(i) for i in range(m.n_layers))}
        if set(m.checksums) != expected:
            raise StoreError(f"corpus {corpus_id}: manifest lists {sorted(m.checksums)}")
        for name in sorted(expected if names is None else names):
            path = self.corpora / corpus_id / name
            if not path.is_file() or _sha256_file(path) != m.checksums[name]:
                raise CorruptPages(f"corpus {corpus_id}: {name} is missing or fails its checksum")

    def size(self, corpus_id: str) -> int:
        """Bytes of a stored corpus's files (0 when it is not stored)."""
        d = self.corpora / corpus_id
        return sum(f.stat().st_size for f in d.iterdir() if f.is_file()) if d.is_dir() else 0

    # -- writing ----------------------------------------------------------------------------------
    def delete(self, corpus_id: str) -> int:
        """Remove a stored corpus (even one whose files fail their checks); returns the bytes it
        took. It leaves ``corpora/`` by one rename into ``tmp/``, so no reader sees half of it
        and a crash midway leaves a temp directory that the next open removes. Raises StoreError
        when ``corpus_id`` is not a stored corpus."""
        if corpus_id not in self.ids():  # also refuses anything that is not a plain directory
            raise StoreError(f"corpus {corpus_id[:80]!r} is not in the store at {self.root}")
        size = self.size(corpus_id)
        gone = self.tmp / f"{corpus_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        os.rename(self.corpora / corpus_id, gone)
        _fsync(self.corpora)
        shutil.rmtree(gone, ignore_errors=True)
        return size

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
