"""Which corpus a request is bound to, and whether that corpus may serve this model.

A request names its corpus twice, with the same string, because SGLang carries each to a
different place and neither alone is enough (SGLang 0.5.10.post1):

- ``rid = "corpusd:<corpus>:<unique>"``: the request id is the one per-request string that
  reaches the model's forward (``ForwardBatch.rids``, set in ``ForwardBatch.init_new``), so the
  entry model and the attention backend read the binding from it;
- ``extra_key = "corpusd:<corpus>"``: the radix cache's key (``RadixKey(token_ids, extra_key)``
  in ``Req.init_next_round_input``) matches only equal extra keys, so a bound request never
  reuses the KV of an unbound one (or of another corpus's) with the same tokens: those KV rows
  sit at other positions and attended to another context.

:func:`request_fields` makes both; the README's example uses it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from corpusd.corpus.head import repeated
from corpusd.corpus.names import CorpusNameError, resolve_name

PREFIX = "corpusd:"


class CorpusBindingError(ValueError):
    """A request names a corpus that cannot serve it (unknown, not ready, other model)."""


@dataclass(frozen=True, slots=True)
class Binding:
    corpus_id: str
    name: str
    tokens: int  # T: the request's own tokens start at logical position T
    page_size: int
    head_len: int = 0  # the corpus's head (corpusd/corpus/head.py); 0: not known
    head_digest: str = ""

    def repeated_in(self, ids: Sequence[int] | None) -> str | None:
        """Why prompt ``ids`` of a request bound here cannot be served (it repeats the corpus:
        :func:`corpusd.corpus.head.repeated`); None when it can."""
        if ids is None:
            return None
        why = repeated(ids, self.head_len, self.head_digest, self.name, self.tokens)
        return None if why is None else f"the prompt {why}, or send the whole prompt unbound"


def check_name(corpus: str) -> str:
    if not corpus or ":" in corpus or any(c.isspace() for c in corpus):
        raise CorpusBindingError(
            f"corpus name {corpus!r}: give a non-empty corpus name or id without ':' or spaces"
        )
    return corpus


def request_fields(corpus: str, rid: str = "") -> dict[str, str]:
    """The fields that bind a SGLang request (``/generate`` body or ``Engine.generate`` kwargs)
    to ``corpus``: ``rid`` and ``extra_key``. ``rid`` defaults to a fresh uuid4 suffix."""
    check_name(corpus)
    return {
        "rid": f"{PREFIX}{corpus}:{rid or uuid.uuid4().hex}",
        "extra_key": extra_key(corpus),
    }


def extra_key(corpus: str) -> str:
    """The radix-cache extra key of requests bound to ``corpus``."""
    return PREFIX + check_name(corpus)


def corpus_of_rid(rid: str | None) -> str | None:
    """The corpus a request id binds to, or None for an ordinary request. Raises
    CorpusBindingError on ``corpusd:`` ids that are malformed."""
    if not rid or not rid.startswith(PREFIX):
        return None
    name, sep, unique = rid[len(PREFIX) :].partition(":")
    if not sep or not unique:
        raise CorpusBindingError(f"request id {rid!r}: want 'corpusd:<corpus>:<unique>'")
    return check_name(name)


def corpora_of_batch(rids: Sequence[str | None] | None, batch_size: int) -> list[str | None]:
    """Per request of a forward batch: its corpus name or None. SGLang may pad a batch (CUDA
    graphs, DP attention); padded rows are unbound."""
    rids = list(rids or [])
    return [corpus_of_rid(r) for r in rids[:batch_size]] + [None] * (batch_size - len(rids))


@dataclass(frozen=True, slots=True)
class PinnedCorpus:
    """What the coordinator says of a corpus (a subset of its ``CorpusStatus``)."""

    corpus_id: str
    name: str
    state: str
    tokens: int
    page_size: int
    model_fingerprint: str
    head_len: int = 0  # corpusd/corpus/head.py: its first token ids' digest (0: unknown)
    head_digest: str = ""


def resolve(
    name: str, corpora: Sequence[PinnedCorpus], fingerprint: str, page_size: int
) -> Binding:
    """The ready corpus ``name`` means (``resolve_name``: an id, a unique name, or a unique id
    prefix of ≥ 8 characters), checked against this server's model. Raises CorpusBindingError
    with what to do."""
    try:
        c = resolve_name(name, corpora)
    except CorpusNameError as e:
        raise CorpusBindingError(str(e)) from None
    if c.model_fingerprint != fingerprint:
        raise CorpusBindingError(
            f"corpus {name!r} was pinned for model {c.model_fingerprint}, but this SGLang "
            f"server runs {fingerprint}; pin it with this server's --model-path"
        )
    if c.page_size != page_size:
        raise CorpusBindingError(
            f"corpus {name!r} has {c.page_size}-token pages; this server's --page-size is "
            f"{page_size}"
        )
    return Binding(c.corpus_id, c.name, c.tokens, c.page_size, c.head_len, c.head_digest)
