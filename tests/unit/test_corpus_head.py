"""A corpus's head (``corpusd/corpus/head.py``): a prompt that holds the corpus's first tokens
near its start (with or without the corpus's BOS, after a chat template) is told apart from one
that does not, whatever follows; nothing is claimed when no head is known or the corpus is too
short to have one."""

from __future__ import annotations

import hashlib

import torch

from corpusd.corpus.head import (
    HEAD_MIN,
    HEAD_SKIP,
    HEAD_TOKENS,
    HEAD_WITHIN,
    corpus_head,
    head_digest,
    head_offset,
    repeated,
)

BOS = 0


def _corpus(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS, *torch.randint(2, 16384, (n - 1,), generator=g).tolist()]


def test_a_prompt_that_repeats_the_corpus_is_recognised_with_or_without_its_bos() -> None:
    ids = _corpus(900, 1)
    n, digest = corpus_head(torch.tensor(ids))
    assert n == HEAD_TOKENS and len(digest) == 64
    assert head_offset([*ids, 5, 6, 7], n, digest) == HEAD_SKIP  # the corpus, then a question
    assert head_offset([*ids[1:], 5], n, digest) == 0  # its text without the BOS
    assert head_offset(ids[HEAD_SKIP : HEAD_SKIP + n], n, digest) == 0
    assert head_offset(ids[2:], n, digest) is None  # shifted by one more: not the head
    assert head_offset(ids[: HEAD_SKIP + n - 1], n, digest) is None  # too short to tell
    changed = list(ids)
    changed[HEAD_SKIP + n - 1] += 1
    assert head_offset(changed, n, digest) is None  # the head's last token differs
    assert head_offset(ids, 0, "") is None  # no head known: no claim


def test_the_head_is_found_after_a_template_or_a_system_line_and_not_past_the_window() -> None:
    ids = _corpus(300, 2)
    n, digest = corpus_head(torch.tensor(ids))
    template = [BOS, 11, 12, 13]  # BOS and a chat role's tokens, then the corpus's text
    assert head_offset([*template, *ids[1:], 5], n, digest) == len(template)
    late = [7] * (HEAD_WITHIN + 1)
    assert head_offset([*late, *ids[1:]], n, digest) is None  # too far in to be looked for
    assert head_offset([*late[:-1], *ids[1:]], n, digest) == HEAD_WITHIN


def test_the_refusal_says_which_tokens_stand_where() -> None:
    ids = _corpus(300, 3)
    n, digest = corpus_head(torch.tensor(ids))
    why = repeated([9, 9, *ids[1:], 5], n, digest, "repo", len(ids))
    assert why is not None and why.startswith("repeats corpus 'repo' (its tokens 1-64 stand ")
    assert "the prompt's 2-65" in why and "(300 tokens)" in why and "\n" not in why
    assert repeated([9, 9, 5], n, digest, "repo", len(ids)) is None


def test_a_short_corpus_has_no_head_and_the_digest_reads_int32_little_endian() -> None:
    assert corpus_head(torch.tensor(_corpus(HEAD_SKIP + HEAD_MIN - 1, 4))) == (0, "")
    ids = _corpus(HEAD_SKIP + HEAD_MIN, 5)
    n, digest = corpus_head(torch.tensor(ids, dtype=torch.int32))
    raw = b"".join(v.to_bytes(4, "little") for v in ids[HEAD_SKIP:])
    assert n == HEAD_MIN and digest == hashlib.sha256(raw).hexdigest() == head_digest(ids[1:])
