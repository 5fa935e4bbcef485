"""The corpus as one token stream: BOS, then every file as a path header and its text."""

from __future__ import annotations

from dataclasses import dataclass

from corpusd.corpus.ingest import CorpusError, Ingested
from corpusd.tokenizer import Tokenizer

FILE_HEADER = "### file: {path}\n"


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Tokens ``[start, end)`` of the stream hold this file's header and text."""

    path: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Layout:
    tokens: tuple[int, ...]
    spans: tuple[FileSpan, ...]


def render(
    ingested: Ingested,
    tokenizer: Tokenizer,
    max_tokens: int,
    remedy: str = "raise --max-tokens or pin a smaller corpus",
) -> Layout:
    """Tokenize the files in order, each preceded by ``FILE_HEADER`` and ending in a newline.

    Raises CorpusError as soon as the stream would exceed ``max_tokens`` (before tokenizing
    the rest), naming the limit, the file that crossed it and ``remedy``.
    """
    tokens: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    spans: list[FileSpan] = []
    for f in ingested.files:
        text = f.text if f.text.endswith("\n") else f.text + "\n"
        start = len(tokens)
        tokens += tokenizer.encode(FILE_HEADER.format(path=f.path))
        tokens += tokenizer.encode(text)
        if len(tokens) > max_tokens:
            raise CorpusError(
                f"corpus exceeds the token limit of {max_tokens:,} at file {f.path!r} "
                f"(already {len(tokens):,} tokens); {remedy}"
            )
        spans.append(FileSpan(f.path, start, len(tokens)))
    return Layout(tuple(tokens), tuple(spans))
