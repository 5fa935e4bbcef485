"""A corpus's head: the SHA-256 of its first token ids, by which a request bound to the corpus
is told apart from one that repeats the corpus in its own prompt.

A bound request carries only what follows the corpus; its corpus is attended from the holders.
A client that also sends the corpus text gets it attended twice (once as the prompt's own
tokens), and answers that are wrong without any error. The coordinator publishes each corpus's
head (``CorpusInfo.head_len`` / ``head_digest``); the SGLang plugin refuses, at admission, a
bound prompt that holds it within its first :data:`HEAD_WITHIN` tokens (at the start, or after a
chat template's or a system line's tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

HEAD_TOKENS = 64  # long enough that no question starts with the corpus by chance


def head_digest(ids: Sequence[int] | torch.Tensor) -> str:
    """SHA-256 (hex) over ``ids`` as int32 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def corpus_head(tokens: torch.Tensor) -> tuple[int, str]:
    """``(head_len, digest)`` of a corpus's token ids: its first ``min(T, HEAD_TOKENS)``."""
    n = min(int(tokens.numel()), HEAD_TOKENS)
    return n, head_digest(tokens[:n])


#: How far into a prompt the head is looked for: a chat template's or a system line's tokens
#: may stand before the corpus (one SHA-256 of 256 bytes an offset: about 0.1 ms for them all).
HEAD_WITHIN = 128


def head_offset(
    ids: Sequence[int], head_len: int, digest: str, within: int = HEAD_WITHIN
) -> int | None:
    """Where prompt ``ids`` holds a corpus's head: its first offset ``≤ within`` at which the
    next ``head_len`` ids hash to ``digest``; None when nowhere there, or no head is known."""
    if head_len <= 0 or not digest or len(ids) < head_len:
        return None
    last = min(within, len(ids) - head_len)
    raw = np.asarray(list(ids[: last + head_len]), dtype="<i4").tobytes()
    for o in range(last + 1):
        if hashlib.sha256(raw[4 * o : 4 * (o + head_len)]).hexdigest() == digest:
            return o
    return None


def repeated(
    ids: Sequence[int], head_len: int, digest: str, name: str, tokens: int
) -> str | None:
    """Why prompt ``ids`` of a request bound to corpus ``name`` (``tokens`` long, whose head is
    ``head_len`` / ``digest``) cannot be served, said of the prompt ("starts with …"): it holds
    the corpus's own first tokens near its start (:func:`head_offset`), so the corpus would be
    attended twice. None when it can. The one rule and message of the SGLang plugin's
    admission and corpusd's own agent."""
    at = head_offset(ids, head_len, digest)
    if at is None:
        return None
    where = "starts with" if at == 0 else f"holds, from its token {at},"
    return (
        f"{where} the first {head_len} tokens of corpus {name!r}, which this "
        f"request is bound to and attends from the holders: send only what follows the corpus "
        f"({tokens} tokens), or send the whole prompt unbound"
    )


def starts_with_head(ids: Sequence[int], head_len: int, digest: str) -> bool:
    """Whether prompt ``ids`` begins with a corpus's head (False when no head is known)."""
    return head_offset(ids, head_len, digest, within=0) == 0
