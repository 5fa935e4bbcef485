"""Which corpus a caller means: the one rule by which the agent, the SGLang link and the local
page store turn what a user typed (an id, a name, an id prefix) into a corpus."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, Protocol, TypeVar

#: Shortest id prefix accepted. Ids are 32 hex digits; 8 digits tell 2^32 ids apart, so a prefix
#: that long stays unique among any store's corpora, and one that short is still easy to type.
MIN_PREFIX = 8

Reason = Literal["unknown", "ambiguous", "not_ready"]


class Named(Protocol):
    """What the rule reads of a candidate (``CorpusStatus``, ``PinnedCorpus``, ...)."""

    @property
    def corpus_id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> str: ...


C = TypeVar("C", bound=Named)


class CorpusNameError(LookupError):
    """A name that means no ready corpus. ``reason``: ``unknown`` (nothing matches),
    ``ambiguous`` (several corpora match) or ``not_ready`` (the one that matches is pinning or
    queued: ``corpus_id``/``state`` say which). ``str(self)`` is a one-line message; ``known``
    lists the live corpora and ``hint`` (maybe empty) says what to do, for callers that phrase
    their own message."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        known: str = "",
        hint: str = "",
        corpus_id: str = "",
        state: str = "",
    ) -> None:
        super().__init__(message)
        self.reason, self.known, self.hint = reason, known, hint
        self.corpus_id, self.state = corpus_id, state


def resolve_name(name: str, candidates: Iterable[C]) -> C:
    """The ready corpus ``name`` means among ``candidates`` (retired ones are ignored): the one
    whose id is ``name``, else the one named ``name``, else the one whose id starts with
    ``name`` when ``name`` has at least ``MIN_PREFIX`` (8) characters. Where several match
    (two corpora with one name: a re-pin of changed content), the ready one is meant.

    Raises:
        CorpusNameError: ``unknown`` (its message names the live corpora, and that an id
            prefix needs ≥ 8 characters when a shorter one would have matched), ``ambiguous``
            (more than one ready corpus, or several and none ready), ``not_ready``.
    """
    live = [c for c in candidates if c.state != "retired"]
    hits = [c for c in live if c.corpus_id == name] or [c for c in live if c.name == name]
    if not hits and len(name) >= MIN_PREFIX:
        hits = [c for c in live if c.corpus_id.startswith(name)]
    if not hits:
        known = ", ".join(sorted(c.name or c.corpus_id[:12] for c in live)) or "none"
        short = bool(name) and any(c.corpus_id.startswith(name) for c in live)
        hint = f"an id prefix needs at least {MIN_PREFIX} characters" if short else ""
        raise CorpusNameError(
            "unknown",
            f"unknown corpus {name!r}; pinned: {known}" + (f" ({hint})" if hint else ""),
            known=known,
            hint=hint,
        )
    ready = [c for c in hits if c.state == "ready"]
    if len({c.corpus_id for c in ready}) == 1:
        return ready[0]
    ids = sorted({c.corpus_id for c in ready or hits})
    if len(ids) > 1:
        raise CorpusNameError(
            "ambiguous",
            f"corpus {name!r} is ambiguous: {', '.join(i[:12] for i in ids)}; give the id",
        )
    c = hits[0]
    raise CorpusNameError(
        "not_ready",
        f"corpus {name!r} ({c.corpus_id}) is {c.state}, not ready",
        corpus_id=c.corpus_id,
        state=c.state,
    )


def resolve_in(name: str, *groups: Iterable[C]) -> C | None:
    """The corpus ``name`` means by the same rule (an id, else a name, else an id prefix of at
    least ``MIN_PREFIX`` characters), whatever its state, for commands that act on corpora that
    are not ready: unpin a queued one, delete a retired one. At each step of the rule the groups
    are searched in turn and the first that matches wins, so a caller lists first the corpora
    it most likely means (``unpin``: the pinned ones, then the retired). None: nothing matches.

    Raises:
        CorpusNameError: ``ambiguous`` when several corpora of one group match at one step.
    """
    lists = [list(g) for g in groups]
    steps: tuple[Callable[[Named], bool], ...] = (
        lambda c: c.corpus_id == name,
        lambda c: c.name == name,
        lambda c: len(name) >= MIN_PREFIX and c.corpus_id.startswith(name),
    )
    for matches in steps:
        for group in lists:
            hits = {c.corpus_id: c for c in group if matches(c)}
            if len(hits) > 1:
                ids = ", ".join(sorted(i[:12] for i in hits))
                raise CorpusNameError(
                    "ambiguous", f"corpus {name!r} is ambiguous: {ids}; give the id"
                )
            if hits:
                return next(iter(hits.values()))
    return None


#: Archive suffixes a default corpus name drops (longest first, so ``.tar.gz`` goes whole).
ARCHIVE_SUFFIXES = (".tar.gz", ".tar.bz2", ".tar.xz", ".tar.zst", ".tgz", ".tar")


def default_name(source: str) -> str:
    """The name a pin of ``source`` gets without ``--name``: its file or directory name less a
    known archive suffix, so a version stays in it (``h11-0.14.0.tar`` → ``h11-0.14.0``; two
    versions of a package do not collide). "" when nothing is left."""
    base = source.rstrip("/").rsplit("/", 1)[-1]
    for suffix in ARCHIVE_SUFFIXES:
        if base.lower().endswith(suffix) and len(base) > len(suffix):
            return base[: -len(suffix)]
    return base
