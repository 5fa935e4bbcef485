"""The two ways a requester selects over corpus + its own tokens, as pure functions.

``replica``: the requester keeps the corpus's index keys and scores them itself; the session's
scores are laid out in logical order (private prefix ‖ corpus ‖ private suffix) and one
:func:`select_topk` picks. ``distributed``: holders return their local top-k over the pages they
hold; the union with the session's own scored tokens contains the global top-k, which
:func:`merge_topk` extracts. Both use the order (score desc, position asc), so they select the
same set as the model's own indexer over the full sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from indexer.select import merge_topk, select_topk


def local_topk(
    scores: torch.Tensor, pos: torch.Tensor, limit: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``distributed``, phase one: the top-``k`` of the keys one party holds (a holder's pages,
    or a failed holder's scored from the page store), for :func:`merge_topk` to merge.

    Args:
        scores: ``[n, m]`` index scores of the held keys.
        pos: int64 ``[m]`` their canonical positions, ascending.
        limit: int64 ``[n]``: row ``i`` may only select positions ``< limit[i]``.
        k: ``index_topk``.

    Returns:
        positions int64 ``[n, k]`` (``-1`` where fewer than ``k`` keys lie below the limit) and
        their scores (``-inf`` there).
    """
    scores = scores.masked_fill(pos[None, :] >= limit[:, None], float("-inf"))
    cols = select_topk(scores, k)
    picked = torch.where(cols >= 0, pos[cols.clamp(min=0)], -1)
    vals = torch.where(cols >= 0, scores.gather(1, cols.clamp(min=0)), float("-inf"))
    return picked, vals


def select_replica(
    private_scores: torch.Tensor,
    corpus_scores: torch.Tensor,
    offset: int,
    positions: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Top-k over one session's rows.

    Args:
        private_scores: float32 ``[n, P]`` scores of the session's private rows (logical order).
        corpus_scores: float32 ``[n, T]`` scores of the corpus keys (canonical order).
        offset: logical position of the corpus's first token (private prefix length).
        positions: int64 ``[n]`` logical positions of the rows (a row sees positions ≤ its own).
        k: ``index_topk``.

    Returns:
        int64 ``[n, k]`` logical positions, ascending, ``-1`` padded.
    """
    full = torch.cat([private_scores[:, :offset], corpus_scores, private_scores[:, offset:]], dim=1)
    return select_topk(full, k, positions + 1)


def select_distributed(
    private_scores: torch.Tensor,
    private_logical: torch.Tensor,
    corpus_parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    offset: int,
    positions: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Top-k from holders' local top-k lists plus the session's own rows.

    Args:
        private_scores: float32 ``[n, P]``; private_logical: int64 ``[P]`` their positions.
        corpus_parts: per holder ``(canonical positions [n, k_h] (-1 padded), scores [n, k_h])``,
            each that holder's own top-k of the positions the row may see.
        offset, positions, k: as in :func:`select_replica`.

    Returns:
        int64 ``[n, k]`` logical positions, ascending, ``-1`` padded.
    """
    n = positions.shape[0]
    visible = private_logical[None, :] <= positions[:, None]
    pos = [torch.where(visible, private_logical[None, :].expand(n, -1), -1)]
    scores = [private_scores]
    for cpos, cscore in corpus_parts:
        pos.append(torch.where(cpos >= 0, cpos + offset, -1))
        scores.append(cscore)
    return merge_topk(torch.cat(pos, dim=1), torch.cat(scores, dim=1), k)
