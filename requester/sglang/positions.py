"""Positions and the rope band's layout at the SGLang boundary.

The corpus sits at canonical positions ``0 … T−1`` and is not in the worker's KV pool, so a
bound request's own tokens are prefilled at ``T, T+1, …``: SGLang computes positions from 0 for
the tokens it holds, and :func:`shift_positions` adds each request's corpus length. The query
for the corpus partial then needs no rotation: it already sits at its logical position and the
corpus keys at their canonical ones (route with offset 0, DESIGN "Positions").

Layout: SGLang's DeepSeek rope is GPT-J style (``is_neox_style=False``): the 64-wide band stays
as interleaved pairs ``(x0, x1), (x2, x3), …`` after rotation. corpusd stores ``k_pe``
de-interleaved after rotation (``[evens ‖ odds]``, transformers' layout). A dot product is
unchanged when both sides go through the same permutation, so a query sent to corpusd has its
band de-interleaved (:func:`to_corpusd_layout`), and a cache row served to SGLang's pool has its
band re-interleaved (:func:`to_sglang_layout`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from corpusd.engine.spool import deinterleave, interleave
from corpusd.kernels.formats import D_ROPE, D_V

__all__ = ["deinterleave", "interleave"]  # the band's permutation, shared with the spool

ROPE_START, ROPE_WIDTH = D_V, D_ROPE  # V3.2: c_KV 512 ‖ k_pe 64
INDEX_DIM = 128  # V3.2's index keys, as SGLang's NSA pages hold them


def shift_positions(
    positions: torch.Tensor, corpus_len: torch.Tensor, tokens_per_request: torch.Tensor
) -> torch.Tensor:
    """``positions [N]`` (SGLang's, per token, requests back to back) + each token's request's
    corpus length. ``corpus_len [B]`` (0 for an unbound request) and ``tokens_per_request [B]``
    (extend lengths; all 1 in decode) must sum to N. Returns a new int64 tensor."""
    assert corpus_len.shape == tokens_per_request.shape, (
        f"{corpus_len.shape=} vs {tokens_per_request.shape=}"
    )
    n = int(tokens_per_request.sum())
    assert positions.shape == (n,), f"{positions.shape=}, the requests hold {n} tokens"
    offset = torch.repeat_interleave(
        corpus_len.to(positions.device), tokens_per_request.to(positions.device)
    )
    return positions.to(torch.int64) + offset


@contextmanager
def shifted_positions(forward_batch: Any, shifted: torch.Tensor) -> Iterator[torch.Tensor]:
    """Within the block, ``forward_batch.positions`` is ``shifted`` (a backend that reads the
    batch's positions, such as SGLang's trtllm fp8 path, sees the corpus-shifted ones); after
    it, the caller's tensor again.

    The restore is what makes CUDA graphs correct: SGLang's graph runner passes one
    ``ForwardBatch`` to two warm-up runs and the capture, each called with
    ``forward_batch.positions``. Left replaced, the capture would read the second warm-up's
    tensor (shifted twice, allocated outside the graph's pool and freed with the batch) instead
    of the runner's static positions buffer: every replay then reads freed memory, which crashed
    the rope's cache lookup once larger graphs had been captured (issue 17)."""
    original = forward_batch.positions
    forward_batch.positions = shifted
    try:
        yield shifted
    finally:
        forward_batch.positions = original


def to_corpusd_layout(
    x: torch.Tensor, start: int = ROPE_START, width: int = ROPE_WIDTH
) -> torch.Tensor:
    """A copy of ``x [..., start + width]`` (SGLang: absorbed q or a cache row) with its rope
    band de-interleaved, as corpusd's holders expect."""
    out = x.clone()
    out[..., start : start + width] = deinterleave(x[..., start : start + width])
    return out


def to_sglang_layout(
    x: torch.Tensor, start: int = ROPE_START, width: int = ROPE_WIDTH
) -> torch.Tensor:
    """A copy of corpusd's row(s) ``x`` with the rope band re-interleaved (SGLang's pool)."""
    out = x.clone()
    out[..., start : start + width] = interleave(x[..., start : start + width])
    return out
