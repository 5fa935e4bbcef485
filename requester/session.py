"""A sub-agent's session: a copy-on-write fork of a pinned corpus plus its private tokens.

Logical positions of a session: its private *prefix* (``offset`` tokens, e.g. a system prompt)
at ``0 … offset−1``, the corpus at ``offset … offset+T−1`` (its pages stay on holders, stored at
canonical positions ``0 … T−1``), then its own tokens at ``offset+T …``. The private cache (a
``KVCache``) holds only the session's own rows (prefix and suffix), in logical order; the corpus
is never copied. A step writes its rows layer by layer and commits the length at its end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from corpusd.model import KVCache
from requester.corpus_view import CorpusView
from requester.sampling import SamplingParams


@dataclass(eq=False)
class Session:
    """One sub-agent. ``prefix`` tokens precede the corpus; ``pending`` are fed at the next step.

    Not thread-safe: one worker steps it at a time.
    """

    id: str
    corpus: CorpusView
    offset: int
    cache: KVCache  # the session's own rows (prefix, then suffix) in logical order
    pending: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    gen: torch.Generator = field(default_factory=torch.Generator)
    logits: list[torch.Tensor] | None = None  # each step's logits, when the opener asked
    used_at: float = field(default_factory=time.monotonic)  # last call or token (idle expiry)

    def logical(self, private_index: torch.Tensor) -> torch.Tensor:
        """Private cache index → logical position (the corpus sits between prefix and suffix)."""
        t = self.corpus.token_count
        return torch.where(private_index < self.offset, private_index, private_index + t)

    def private_index(self, logical: torch.Tensor) -> torch.Tensor:
        """Logical position of a private row → its private cache index."""
        t = self.corpus.token_count
        return torch.where(logical < self.offset, logical, logical - t)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)
