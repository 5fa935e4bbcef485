"""A sub-agent's session: a copy-on-write fork of a pinned corpus plus its private tokens.

Logical positions of a session: its private *prefix* (``offset`` tokens, e.g. a system prompt)
at ``0 … offset−1``, the corpus at ``offset … offset+T−1`` (its pages stay on holders, stored at
canonical positions ``0 … T−1``), then its own tokens at ``offset+T …``. The private cache holds
only the session's own rows (prefix and suffix), in logical order; the corpus is never copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from corpusd.model import ModelConfig
from requester.corpus_view import CorpusView
from requester.sampling import SamplingParams


class PrivateCache:
    """Per-layer latent rows ``[cap, kv_dim]`` and index keys ``[cap, D_I]`` of a session's own
    tokens, in logical order. Rows are written layer by layer during a step and become visible
    to later steps when the step commits its length."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, capacity: int = 64) -> None:
        self.length = 0
        self.latent = [torch.zeros(capacity, cfg.kv_dim, dtype=dtype)]
        self.latent += [torch.zeros_like(self.latent[0]) for _ in range(cfg.num_hidden_layers - 1)]
        self.keys = [
            torch.zeros(capacity, cfg.index_head_dim, dtype=dtype)
            for _ in range(cfg.num_hidden_layers)
        ]

    def reserve(self, n: int) -> None:
        need = self.length + n
        cap = self.latent[0].shape[0]
        if need <= cap:
            return
        cap = max(need, 2 * cap)
        for store in (self.latent, self.keys):
            for i, t in enumerate(store):
                grown = t.new_zeros(cap, t.shape[1])
                grown[: self.length] = t[: self.length]
                store[i] = grown

    @property
    def nbytes(self) -> int:
        return sum(t[: self.length].nbytes for t in (*self.latent, *self.keys))


@dataclass(eq=False)
class Session:
    """One sub-agent. ``prefix`` tokens precede the corpus; ``pending`` are fed at the next step.

    Not thread-safe: one worker steps it at a time.
    """

    id: str
    corpus: CorpusView
    offset: int
    cache: PrivateCache
    pending: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    gen: torch.Generator = field(default_factory=torch.Generator)
    logits: list[torch.Tensor] | None = None  # each step's logits, when the opener asked

    def logical(self, private_index: torch.Tensor) -> torch.Tensor:
        """Private cache index → logical position (the corpus sits between prefix and suffix)."""
        t = self.corpus.token_count
        return torch.where(private_index < self.offset, private_index, private_index + t)

    def private_index(self, logical: torch.Tensor) -> torch.Tensor:
        """Logical position of a private row → its private cache index."""
        t = self.corpus.token_count
        return torch.where(logical < self.offset, logical, logical - t)

    @property
    def next_position(self) -> int:
        return int(self.logical(torch.tensor(self.cache.length)))

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)
