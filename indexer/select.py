"""Exact top-k selection with deterministic ties (the lowest position wins)."""

from __future__ import annotations

import torch


def select_topk(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """Pick the ``k`` best-scoring keys of every row.

    One ``topk(k + 1)`` decides most rows: where the k-th best score is finite and beats the
    (k+1)-th, no tie straddles the cut and the top k are the answer. Without ``limit`` that
    ``topk`` is unsorted (its two lowest values are the k-th and (k+1)-th best). Rows with a
    tie at the cut, fewer than k eligible keys, or a NaN/inf among their best (``topk`` ranks
    NaN highest) go through :func:`select_topk_exact`, which defines the result. Under
    causality only the last ``T - min(limit)`` columns need masking: they are scored apart (a
    copy of that tail, not of the row), and the two candidate lists merged, since the row's top
    ``k + 1`` lies in their union. A scorer that masks itself (``index_scores(..., limit)``)
    needs no ``limit`` here. Same output as :func:`select_topk_exact`, bit for bit.

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
    if k >= t or n == 0:
        return select_topk_exact(scores, k, limit)
    if limit is None:
        # unsorted top (k + 1): the two lowest of it are the k-th and (k+1)-th best scores
        vals, idx = scores.float().topk(k + 1, dim=1, sorted=False)
        low = vals.topk(2, dim=1, largest=False)
        nxt, kth = low.values[:, 0], low.values[:, 1]
        nonfinite = (~torch.isfinite(vals)).sum(dim=1) - (~torch.isfinite(nxt)).long()
        clean = (kth > nxt) & (nonfinite == 0)
        out = idx.scatter(1, low.indices[:, :1], t).sort(dim=1).values[:, :k]
    else:
        vals, idx = _top(scores, k + 1, limit)
        kth, nxt = vals[:, k - 1], vals[:, k]
        clean = (kth > nxt) & torch.isfinite(vals[:, :k]).all(dim=1)
        out = idx[:, :k].sort(dim=1).values
    if not bool(clean.all()):
        rows = (~clean).nonzero().flatten()
        sub = None if limit is None else limit[rows]
        out[rows] = select_topk_exact(scores[rows], k, sub)
    return out


def _top(
    scores: torch.Tensor, m: int, limit: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk(m)`` of every row with positions ``>= limit`` excluded (``-inf``); values and
    positions ``[n, m]``, best first. Needs ``m <= T``."""
    t = scores.shape[1]
    lo = t if limit is None else max(0, min(t, int(limit.min())))
    if limit is None or lo == t:
        return scores.float().topk(m, dim=1)
    pos = torch.arange(lo, t, device=scores.device)
    tail = scores[:, lo:].float().masked_fill(pos[None, :] >= limit[:, None], float("-inf"))
    if lo < m:  # too few unmasked columns to take m from: mask a full copy
        full = torch.cat([scores[:, :lo].float(), tail], dim=1)
        return full.topk(m, dim=1)
    hv, hi = scores[:, :lo].float().topk(m, dim=1)
    tv, ti = tail.topk(min(m, t - lo), dim=1)
    v, j = torch.cat([hv, tv], dim=1).topk(m, dim=1)
    return v, torch.cat([hi, ti + lo], dim=1).gather(1, j)


def select_topk_exact(
    scores: torch.Tensor, k: int, limit: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`select_topk` by definition, over the whole ``[n, T]`` matrix: the reference the
    fast path falls back to (and is tested against)."""
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


def merge_topk(positions: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exact global top-k from candidate lists (the distributed indexer's second phase).

    Args:
        positions: int64 ``[n, m]`` candidate positions, ``-1`` = no candidate. A position may
            repeat (a page held by two replicas); it is counted once.
        scores: float32 ``[n, m]`` their scores (ignored where the position is ``-1``).
        k: how many to keep per row.

    Returns:
        int64 ``[n, k]`` ascending, ``-1`` padded: the same set :func:`select_topk` picks over
        the full score row, provided every part contributed its own top-k under the same order
        (score descending, then position ascending) — the global top-k is a subset of the union.
    """
    valid = positions >= 0
    if positions.shape[1] > 1:  # drop repeats: after sorting a row, equal neighbours
        srt, order = positions.sort(dim=1)
        dup = torch.zeros_like(valid)
        dup.scatter_(1, order[:, 1:], srt[:, 1:] == srt[:, :-1])
        valid &= ~dup
    s = scores.float().masked_fill(~valid, float("-inf"))
    # Lexicographic (score desc, position asc): stable sort by position, then stable by score.
    by_pos = torch.where(valid, positions, torch.iinfo(torch.int64).max).argsort(dim=1, stable=True)
    s1 = s.gather(1, by_pos)
    by_score = (-s1).argsort(dim=1, stable=True)
    order = by_pos.gather(1, by_score)
    width = min(k, positions.shape[1])
    top = order[:, :width]
    picked = torch.where(valid.gather(1, top), positions.gather(1, top), -1)
    # Ascending with -1 last: sort on a key that puts -1 at the end.
    key = torch.where(picked >= 0, picked, torch.iinfo(torch.int64).max)
    out = picked.gather(1, key.argsort(dim=1))
    if width < k:
        out = torch.cat([out, out.new_full((out.shape[0], k - width), -1)], dim=1)
    return out
