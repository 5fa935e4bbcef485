"""Questions whose answers are spans copied from the corpus: the task the fitted benchmark
checkpoints learn (``tools/fit_tiny.py --task span``) and the benchmarks ask.

A question quotes a short stretch of the corpus and asks what follows it; the prompt ends with
the quote, and the answer is the corpus's own continuation of it::

    <corpus …>

    Q: What follows?
    A: def _splitparam(param):
        a, sep, b = str(param).partition(';')

The prompt ends in the quote so that the first answer token is the corpus's next one (what an
induction head copies), not a separator the model must first learn to skip (with a closing quote
mark and ``A:`` between, a small model fitted 1,600 steps on CPU had not learned to copy).

A model that learned the task answers every question differently, and cannot answer any without
the corpus: agreement between two serving paths then says something about attention over the
corpus, which a model that loops on whitespace whatever it is asked does not (issue 36). A quote
is taken only where it occurs once in the corpus, so its continuation is the one right answer.

The corpora are Python's standard library source (not this repository's text): the fit trains on
the packages' modules (``training_files``), the benchmarks ask about the top-level modules
(:func:`stdlib_corpus`), so no answer was seen in training.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

QUOTE_CHARS = 24  # characters quoted from the corpus
ANSWER_CHARS = 32  # characters of the continuation a question is trained to produce
#: leave out quotes that are mostly blank or punctuation: they rarely occur once
MIN_LETTERS = 8
#: where this Python's standard library lives: the span task's text and the benchmarks' corpora
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True, slots=True)
class SpanQuestion:
    """A question about ``text`` (a corpus): ``prompt`` (what follows the corpus; it ends with
    the quote) and ``answer`` (the corpus's continuation of the quote)."""

    start: int  # the quote's offset in the corpus text
    prompt: str
    answer: str


def question_text(quote: str) -> str:
    """The suffix asking what follows ``quote``: the benchmark's question format."""
    return f"\n\nQ: What follows?\nA: {quote}"


def _quotable(text: str, start: int) -> bool:
    quote = text[start : start + QUOTE_CHARS]
    return (
        len(quote) == QUOTE_CHARS
        and "\n" not in quote
        and sum(c.isalpha() for c in quote) >= MIN_LETTERS
        and text.count(quote) == 1
    )


def span_question(text: str, start: int, answer_chars: int = ANSWER_CHARS) -> SpanQuestion:
    """The question quoting ``text[start : start + QUOTE_CHARS]``; the caller checked it occurs
    once (:func:`questions`)."""
    end = start + QUOTE_CHARS
    return SpanQuestion(start, question_text(text[start:end]), text[end : end + answer_chars])


def questions(
    text: str, n: int, seed: int, lo: int = 0, hi: int | None = None,
    answer_chars: int = ANSWER_CHARS,
) -> list[SpanQuestion]:  # fmt: skip
    """``n`` questions about ``text`` whose quotes start in ``[lo, hi)`` (and whose answers end
    by ``hi``), quotes that occur once in ``text``, at distinct offsets chosen by ``seed``.
    Raises ValueError when the range has fewer than ``n`` quotable offsets."""
    hi = len(text) if hi is None else min(hi, len(text))
    last = hi - QUOTE_CHARS - answer_chars
    rng = random.Random(seed)
    out: list[SpanQuestion] = []
    tried: set[int] = set()
    while len(out) < n:
        if last <= lo or len(tried) >= last - lo:
            raise ValueError(
                f"only {len(out)} of {n} quotable spans in characters {lo}..{hi} of the corpus "
                f"({len(text)} characters): use a longer corpus or fewer questions"
            )
        s = rng.randrange(lo, last)
        if s in tried:
            continue
        tried.add(s)
        if _quotable(text, s) and all(abs(s - q.start) >= QUOTE_CHARS for q in out):
            out.append(span_question(text, s, answer_chars))
    return out


def training_files(limit_bytes: int = 2_000_000) -> list[Path]:
    """Standard-library modules inside packages (``email/``, ``json/`` …; tests and generated
    tables left out), sorted, up to ``limit_bytes``: the span fit's text. The benchmarks' corpora
    are the top-level modules, none of these."""
    files, total = [], 0
    for p in sorted(STDLIB.glob("*/**/*.py")):
        rel = p.relative_to(STDLIB).as_posix()
        if any(part in rel for part in ("test", "site-packages", "idlelib", "lib2to3")):
            continue
        size = p.stat().st_size
        if size < 2_000 or size > 200_000:
            continue
        files.append(p)
        total += size
        if total >= limit_bytes:
            break
    return files


def stdlib_corpus(out: Path, n_bytes: int) -> Path:
    """A directory of ``n_bytes`` of Python's standard library source (not this repo's text),
    in a fixed order, as the corpus every session asks about."""
    out.mkdir(parents=True, exist_ok=True)
    left = n_bytes
    for f in top_level_modules():
        if left <= 0:
            break
        text = f.read_text(errors="replace")[:left]
        (out / f.name).write_text(text)
        left -= len(text.encode())
    return out


def top_level_modules() -> list[Path]:
    """The standard library's top-level modules (``*.py`` beside ``os.py``), sorted: what the
    benchmarks pin and the span fit asks over, none of them in :func:`training_files`."""
    return sorted(STDLIB.glob("*.py"))
