"""One exact top-k over the corpus's candidates and the request's own tokens.

Logical positions: corpus ``0 … T−1``, the request's own token ``j`` at ``T + j``. The corpus
side contributes candidates (its own top-k under the order score desc, position asc — from the
holders' ``IndexTopK`` or from replica keys scored here), the own side its top-k of its causal
window; the global top-k is a subset of the union, which ``indexer.select.merge_topk`` extracts.
The result equals ``select_topk`` over the concatenated score row ``[corpus ‖ own]`` (tests).
"""

from __future__ import annotations

import torch

from indexer.select import merge_topk, select_topk


def own_candidates(
    own_scores: torch.Tensor, own_limit: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the request's own tokens: ``own_scores [n, L]`` float, a row may see own
    positions ``< own_limit[i]``. Returns (own positions ``[n, k]`` -1 padded, their scores
    float32 ``[n, k]``, -inf where -1)."""
    pos = select_topk(own_scores, k, own_limit)
    s = own_scores.float().gather(1, pos.clamp(min=0))
    return pos, s.masked_fill(pos < 0, float("-inf"))


def combined_topk(
    own_pos: torch.Tensor,
    own_scores: torch.Tensor,
    corpus_pos: torch.Tensor,
    corpus_scores: torch.Tensor,
    corpus_len: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Exact top-k of a row's logical sequence from both candidate lists.

    Args:
        own_pos, own_scores: ``[n, k_o]`` own positions (-1 = none) and scores.
        corpus_pos, corpus_scores: ``[n, k_c]`` canonical corpus positions (-1 = none; repeats
            allowed, counted once) and scores. An unbound row has only -1 here.
        corpus_len: int ``[n]`` T of each row's corpus (0 when unbound).
        k: ``index_topk``.

    Returns:
        int64 ``[n, k]`` logical positions ascending, -1 padded.
    """
    logical_own = torch.where(own_pos >= 0, own_pos + corpus_len[:, None], -1)
    pos = torch.cat([corpus_pos.to(torch.int64), logical_own.to(torch.int64)], dim=1)
    return merge_topk(pos, torch.cat([corpus_scores.float(), own_scores.float()], dim=1), k)


def split_selection(
    logical: torch.Tensor, corpus_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a combined selection ``[n, k]`` into (corpus positions, own positions), each
    ``[n, k]`` with -1 where the slot belongs to the other side, so each keeps the width the
    kernels expect (FlashMLA decode asserts ``indices.shape[-1] == index_topk``)."""
    t = corpus_len[:, None].to(logical.dtype)
    valid = logical >= 0
    corpus = torch.where(valid & (logical < t), logical, -1)
    own = torch.where(valid & (logical >= t), logical - t, -1)
    return corpus, own
