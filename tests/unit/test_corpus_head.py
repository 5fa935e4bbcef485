"""A corpus's head (``corpusd/corpus/head.py``): a prompt that starts with the corpus's first
token ids is told apart from one that does not, whatever follows, and nothing is claimed when
the head is not known."""

from __future__ import annotations

import torch

from corpusd.corpus.head import (
    HEAD_TOKENS,
    HEAD_WITHIN,
    corpus_head,
    head_digest,
    head_offset,
    starts_with_head,
)


def test_a_prompt_that_starts_with_the_corpus_is_recognised() -> None:
    tokens = torch.randint(2, 16384, (900,), generator=torch.Generator().manual_seed(1))
    n, digest = corpus_head(tokens)
    assert n == HEAD_TOKENS and len(digest) == 64
    ids = tokens.tolist()
    assert starts_with_head([*ids, 5, 6, 7], n, digest)  # the corpus, then a question
    assert starts_with_head(ids[:n], n, digest)
    assert not starts_with_head(ids[1:], n, digest)  # shifted by one
    assert not starts_with_head([5, 6, 7, *ids], n, digest)  # a question, then the corpus
    assert not starts_with_head(ids[: n - 1], n, digest)  # too short to tell
    changed = list(ids)
    changed[n - 1] += 1
    assert not starts_with_head(changed, n, digest)  # the head's last token differs
    assert not starts_with_head(ids, 0, "")  # no head known: no claim


def test_a_short_corpus_is_its_own_head_and_the_digest_reads_int32_little_endian() -> None:
    n, digest = corpus_head(torch.tensor([1, 2, 300], dtype=torch.int32))
    assert n == 3 and starts_with_head([1, 2, 300, 9], n, digest)
    import hashlib

    raw = b"".join(v.to_bytes(4, "little") for v in (1, 2, 300))
    assert digest == hashlib.sha256(raw).hexdigest() == head_digest([1, 2, 300])


def test_the_head_is_found_after_a_template_or_a_system_line_and_not_past_the_window() -> None:
    tokens = torch.randint(2, 16384, (300,), generator=torch.Generator().manual_seed(2))
    n, digest = corpus_head(tokens)
    ids = tokens.tolist()
    template = [0, 11, 12, 13]  # BOS and a chat role's tokens
    assert head_offset([*template, *ids, 5], n, digest) == len(template)
    assert head_offset([*ids, 5], n, digest) == 0
    late = [7] * (HEAD_WITHIN + 1)
    assert head_offset([*late, *ids], n, digest) is None  # too far in to be looked for
    assert head_offset([*late[:-1], *ids], n, digest) == HEAD_WITHIN
    assert head_offset([*template, *ids[1:]], n, digest) is None  # not the head: one id short
    assert head_offset(ids[: n - 1], n, digest) is None and head_offset(ids, 0, "") is None
