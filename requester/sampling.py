"""Sampling parameters and the per-row sampler (greedy, temperature, nucleus)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a session picks its next tokens. ``temperature == 0`` is greedy; ``top_p`` in
    ``(0, 1)`` keeps the smallest set of tokens whose probability reaches it."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from float32 ``logits [vocab]``. Greedy ties go to the lowest id (argmax)."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True, stable=True)
        # keep tokens whose preceding mass is below top_p (so the first is always kept)
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
