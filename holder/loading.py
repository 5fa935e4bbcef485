"""Loading a pinned corpus's pages from the page store into frames (Assign, and restore at
start-up), all-or-nothing, each page checked against the digest its pin recorded first: a
corrupt page is refused (DATA_LOSS) before any frame is taken, so it is never served."""

from __future__ import annotations

import grpc

from corpusd.corpus.store import CorruptPages, PageStore, StoreError, is_corpus_id
from corpusd.rpc import Reject
from holder.pool import FramePool, PoolFull

S = grpc.StatusCode


class Corrupt(Reject):
    """DATA_LOSS: stored bytes of a corpus failed their digest or could not be read.
    ``pages``: the pages that failed their digest (empty: a whole file could not be read)."""

    def __init__(self, message: str, pages: list[int]) -> None:
        super().__init__(S.DATA_LOSS, message)
        self.pages = pages


def load_pages(
    pool: FramePool,
    store: PageStore,
    fingerprint: str,
    corpus_id: str,
    pages: list[int],
    wanted: dict[int, int] | None = None,
) -> tuple[dict[int, int], bool]:
    """Load ``pages`` (all when empty) of a pinned corpus into frames (the ``wanted`` frames
    when given: a restart restores the same ones). Idempotent; all-or-nothing: on failure no
    frame stays taken.

    Returns:
        (page → frame for the requested pages, whether any page was newly loaded).

    Raises:
        Corrupt: DATA_LOSS, a page (or the manifest) fails its digest or cannot be read.
        Reject: INVALID_ARGUMENT (not a corpus id), NOT_FOUND (not in the store),
            FAILED_PRECONDITION (pinned for another
            geometry or model, or with nothing to check its pages against), OUT_OF_RANGE (no
            such page), RESOURCE_EXHAUSTED (no free frames).
    """
    if not is_corpus_id(corpus_id):  # before it is a path: "../x", or too long to open
        raise Reject(S.INVALID_ARGUMENT, f"corpus_id {corpus_id[:80]!r} is not a corpus id")
    try:
        m = store.manifest(corpus_id)
    except CorruptPages as e:
        raise Corrupt(str(e), []) from None
    except StoreError as e:
        raise Reject(S.NOT_FOUND, str(e)) from None
    geo = pool.geo
    mismatch = [
        f"{k} {a} vs {b}"
        for k, a, b in (
            ("layers", m.n_layers, geo.n_layers),
            ("page_size", m.page_size, geo.page_size),
            ("kv_dim", m.kv_dim, geo.kv_dim),
            ("index_dim", m.index_dim, geo.index_dim),
            ("dtype", m.dtype, str(geo.dtype).removeprefix("torch.")),
            ("kv_format", m.kv_format, geo.kv_format),
        )
        if a != b
    ]
    if m.model_fingerprint != fingerprint:
        mismatch.append("model fingerprint differs")
    if mismatch:
        raise Reject(
            S.FAILED_PRECONDITION,
            f"corpus {corpus_id} does not fit this holder: {', '.join(mismatch)}",
        )
    pages = pages or list(range(m.n_pages))
    bad = [p for p in pages if p >= m.n_pages]
    if bad:
        raise Reject(
            S.OUT_OF_RANGE, f"corpus {corpus_id} has pages 0..{m.n_pages - 1}, asked for {bad[:4]}"
        )
    held = pool.held(corpus_id)
    new = sorted(set(pages) - set(held.pages if held is not None else ()))
    if not new:
        assert held is not None
        return {p: held.pages[p] for p in pages}, False
    try:  # read and check before taking a frame: a refused page changes nothing
        latent, keys = store.read_checked(m, new)
    except CorruptPages as e:
        raise Corrupt(str(e), e.pages) from None
    except StoreError as e:
        raise Reject(S.FAILED_PRECONDITION, str(e)) from None
    held = pool.add_corpus(corpus_id, m.token_count, m.n_pages)
    try:
        frames = pool.take_frames(len(new), [wanted[p] for p in new] if wanted else None)
    except PoolFull as e:
        pool.drop_if_empty(corpus_id)
        raise Reject(S.RESOURCE_EXHAUSTED, f"holder is full: {e}") from None
    try:
        for j, (page, frame) in enumerate(zip(new, frames, strict=True)):
            pool.fill(corpus_id, page, frame, [x[j] for x in latent], [x[j] for x in keys])
    except BaseException:
        for page in new:
            held.pages.pop(page, None)
        pool.return_frames(frames)
        pool.drop_if_empty(corpus_id)
        raise
    return {p: held.pages[p] for p in pages}, True
