"""The oracle's guess check (``corpusd/testing/oracle.py`` ``greedy(..., guess=)``): one
teacher-forced transformers forward over the decode under test's tokens stands in for ``generate``
only where it proves them greedy; a wrong or short guess gets ``generate``'s own tokens. CPU, the
tiny default, a context past index_topk so the selection is real."""

from __future__ import annotations

import pytest
import torch

from corpusd.testing.numeric import rel
from corpusd.testing.oracle import Oracle, Ties, greedy

NEW = 6
SUFFIXES = ["\nQ0: line 3?", "\nQ1: line 40?"]


@pytest.fixture(scope="module")
def corpus(hf_model) -> torch.Tensor:  # type: ignore[no-untyped-def]
    n = hf_model.config.index_topk + 80
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def generated(hf_model, corpus: torch.Tensor):  # type: ignore[no-untyped-def]
    return greedy(hf_model, corpus, SUFFIXES, NEW)


def _same(got, want) -> None:  # type: ignore[no-untyped-def]
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want, strict=True):
        assert tokens == want_tokens
        # a prefill row against a decode step of the same fp32 model: rounding apart
        assert max(rel(a, b) for a, b in zip(logits, want_logits, strict=True)) <= 1e-5


def test_a_right_guess_is_generates_answer_in_one_forward(  # type: ignore[no-untyped-def]
    hf_model, corpus, generated, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_generate(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a right guess must not need generate")

    monkeypatch.setattr(hf_model, "generate", no_generate)
    guess = [tokens for tokens, _ in generated]
    ties = Ties()
    _same(greedy(hf_model, corpus, SUFFIXES, NEW, ties, guess=guess), generated)
    assert set(ties.rows) == {0, 1}, "every layer's indexer ran under the tie rule"


@pytest.mark.parametrize("wrong_at", [0, 3, NEW - 1])
def test_a_wrong_guess_gets_generates_tokens(  # type: ignore[no-untyped-def]
    hf_model, corpus, generated, wrong_at: int
) -> None:
    guess = [list(tokens) for tokens, _ in generated]
    guess[1][wrong_at] = (guess[1][wrong_at] + 1) % hf_model.config.vocab_size
    _same(greedy(hf_model, corpus, SUFFIXES, NEW, guess=guess), generated)


def test_a_short_or_empty_guess_is_continued_and_a_long_one_cut(  # type: ignore[no-untyped-def]
    hf_model, corpus, generated
) -> None:
    (first, _), (second, _) = generated
    _same(greedy(hf_model, corpus, SUFFIXES, NEW, guess=[first[:2], []]), generated)
    _same(greedy(hf_model, corpus, SUFFIXES, NEW, guess=[[*first, 5, 6], second]), generated)
    with pytest.raises(ValueError, match="1 guesses for 2 suffixes"):
        greedy(hf_model, corpus, SUFFIXES, NEW, guess=[first])


def test_the_oracle_computes_as_far_as_asked_and_keeps_it(  # type: ignore[no-untyped-def]
    hf_model, corpus, generated, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = hf_model.forward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_model, "forward", counted)
    oracle = Oracle(hf_model, corpus, SUFFIXES, NEW)
    (first, _), (second, _) = generated
    assert oracle.answer(0, first[:3], n=3)[0] == first[:3] and len(calls) == 1
    assert oracle.answer(0, n=2)[0] == first[:2] and len(calls) == 1  # kept
    # a longer guess is checked by one forward more; a wrong one is generate's all the same
    wrong = [*second[:2], (second[2] + 1) % hf_model.config.vocab_size, *second[3:]]
    _same(oracle.runs([first, wrong]), generated)
    assert oracle.tokens() == [first, second]
    with pytest.raises(ValueError, match="n=7: 0 to 6 tokens"):
        oracle.answer(1, n=NEW + 1)
