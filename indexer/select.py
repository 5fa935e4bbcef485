"""Exact top-k selection with deterministic ties (the lowest position wins)."""

from __future__ import annotations

import torch


def select_topk(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """Pick the ``k`` best-scoring keys of every row.

    Args:
        scores: float ``[n, T]``; column ``t`` is the key at position ``t``.
        k: how many keys to keep per row.
        limit: optional int ``[n]``: row ``i`` may only select positions ``< limit[i]``
            (causality). Positions whose score is ``-inf`` are never selected either.

    Returns:
        int64 ``[n, k]``: selected positions in ascending order, padded with ``-1`` where a row
        has fewer than ``k`` eligible keys. Among equal scores at the cut the lowest positions
        win, so the result does not depend on the top-k kernel's tie order.
    """
    n, t = scores.shape
    pos = torch.arange(t, device=scores.device)
    eligible = torch.isfinite(scores) | (scores == float("inf"))
    if limit is not None:
        eligible &= pos[None, :] < limit[:, None]
    masked = scores.float().masked_fill(~eligible, float("-inf"))
    if k >= t:
        chosen = eligible
    else:
        cut = masked.topk(k, dim=1).values[:, -1:]  # the k-th best score of each row
        above = masked > cut
        at_cut = (masked == cut) & eligible
        need = k - above.sum(dim=1, keepdim=True)
        chosen = above | (at_cut & (at_cut.cumsum(dim=1) <= need))
    # Lowest positions first: rank chosen positions by (t - pos), unchosen get 0.
    key = torch.where(chosen, t - pos[None, :], torch.zeros((), dtype=pos.dtype))
    width = min(k, t)
    top = key.topk(width, dim=1).values
    out = torch.where(top > 0, t - top, torch.full_like(top, -1))
    if width < k:
        out = torch.cat([out, out.new_full((n, k - width), -1)], dim=1)
    return out
