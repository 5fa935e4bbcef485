"""A corpus's head: the SHA-256 of a run of its first token ids, by which a request bound to the
corpus is told apart from one that repeats the corpus in its own prompt.

A bound request carries only what follows the corpus; its corpus is attended from the holders.
A client that also sends the corpus gets it attended twice (once as the prompt's own tokens),
and answers that are wrong without any error. The coordinator publishes each corpus's head
(``CorpusInfo.head_len`` / ``head_digest``): its tokens ``1 … head_len``, the first left out,
since it is the corpus's BOS (which a prompt's copy of the text does not repeat there) or a
token that a text boundary may merge otherwise. The SGLang plugin's admission and corpusd's own
agent refuse a bound prompt that holds the head within its first :data:`HEAD_WITHIN` tokens: at
the start, or after a chat template's or a system line's tokens. A corpus too short for a head
of :data:`HEAD_MIN` tokens has none (a few tokens recur in prompts by chance).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

HEAD_TOKENS = 64  # long enough that no question holds the corpus's by chance
HEAD_MIN = 32  # a shorter corpus publishes no head
HEAD_SKIP = 1  # the corpus's tokens before its head (its BOS, or a boundary's token)
#: How far into a prompt the head is looked for: a chat template's or a system line's tokens
#: may stand before the corpus (one SHA-256 of 256 bytes an offset: about 0.1 ms for them all).
HEAD_WITHIN = 128


def head_digest(ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """SHA-256 (hex) over ``ids`` as int32 little-endian."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def corpus_head(tokens: np.ndarray | torch.Tensor) -> tuple[int, str]:
    """``(head_len, digest)`` of a corpus's token ids (1-D): its tokens ``HEAD_SKIP …`` (at most
    HEAD_TOKENS of them); ``(0, "")`` when fewer than HEAD_MIN follow the skipped ones."""
    n = min(len(tokens) - HEAD_SKIP, HEAD_TOKENS)
    if n < HEAD_MIN:
        return 0, ""
    return n, head_digest(tokens[HEAD_SKIP : HEAD_SKIP + n])


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


def repeated(ids: Sequence[int], head_len: int, digest: str, name: str, tokens: int) -> str | None:
    """Why prompt ``ids`` of a request bound to corpus ``name`` (``tokens`` long, whose head is
    ``head_len`` / ``digest``) cannot be served, said of the prompt ("repeats corpus …"): it
    holds the corpus's head near its start (:func:`head_offset`), so the corpus would be
    attended twice. None when it can. The one rule and message of the SGLang plugin's
    admission and corpusd's own agent."""
    at = head_offset(ids, head_len, digest)
    if at is None:
        return None
    last = HEAD_SKIP + head_len - 1
    return (
        f"repeats corpus {name!r} (its tokens {HEAD_SKIP}-{last} stand at the prompt's "
        f"{at}-{at + head_len - 1}), which this request is bound to and attends from the "
        f"holders: send only what follows the corpus ({tokens} tokens)"
    )
