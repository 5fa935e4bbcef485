"""One exact top-k over the corpus's candidates and the request's own tokens.

Logical positions: corpus ``0 … T−1``, the request's own token ``j`` at ``T + j``. The corpus
side contributes candidates (its own top-k under the order score desc, position asc — from the
holders' ``IndexTopK`` or from replica keys scored here), the own side its top-k of its causal
window; the global top-k is a subset of the union, which ``indexer.select.merge_topk`` extracts.
The result equals ``select_topk`` over the concatenated score row ``[corpus ‖ own]`` (tests).

**SGLang's tie rule** (the device path follows it; :func:`sglang_order`, :func:`sglang_topk`).
Stock SGLang 0.5.10.post1 selects with sgl-kernel's radix select (``nsa_backend.py``
``NSAIndexerMetadata.topk_transform`` → ``fast_topk_v2`` / ``fast_topk_transform_fused`` →
``sgl-kernel/csrc/elementwise/topk.cu``, the same kernel text in every stored version up to the
0.4.x builds). Read at sgl-project/sglang@06c48ca, that file:

- ranks a float32 score by its raw bits (``convert_to_uint32``, lines 71–74: flip every bit of
  a negative float, set the sign bit of a positive one), so ``-0.0`` ranks strictly *below*
  ``+0.0``, a NaN with the sign bit clear above ``+inf``; no score is excluded;
- takes all of a row's positions when its length is ≤ ``topk`` (``naive_topk_cuda``, lines 36–41,
  chosen in ``topk_kernel``), ``-inf`` and NaN included;
- among positions whose 32-bit keys equal the ``topk``-th best (an exact tie at the cut; the
  fourth 8-bit pass, lines 218–222) keeps those whose ``atomicAdd(&s_last_remain, -1)`` comes
  first: shared-memory atomic arrival order, which no rule fixes (two runs on the same scores
  may choose different sets; sglang PR 31115 measured this). Lowest position first is one of the
  outcomes the kernel can produce, and the one corpusd's route takes, so route's choice at a
  tie is always a choice stock could have made, and route is reproducible where stock is not.
- drops candidates past 16,384 in one radix bin (``SMEM_INPUT_SIZE``, line 159): more exact
  ties than that at the cut (a long row of zero scores) leave slots of stock's output unset;
  route never does that.
"""

from __future__ import annotations

import torch

from indexer.select import merge_topk, select_topk

_SIGN = 1 << 31


def sglang_order(scores: torch.Tensor) -> torch.Tensor:
    """sgl-kernel's ``convert_to_uint32`` of each float32 score, as int64 in ``[0, 2³²)``: larger
    key = ranked higher; equal keys = equal bits (so ``-0.0`` < ``+0.0``, unlike ``==``)."""
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits + _SIGN, -1 - bits)  # -1 - bits: ~bits as uint32


def sglang_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The selection stock SGLang's NSA top-k makes, with exact ties at the cut given to the lowest
    positions (one of the kernel's possible outcomes; module docstring): the torch reference the
    device path is tested against.

    Args:
        scores: float32 ``[n, W]``; row ``i`` considers columns ``< lengths[i]``.
        lengths: int ``[n]``.
        k: ``index_topk``.

    Returns:
        int64 ``[n, k]``: selected columns ascending, ``-1`` padded.
    """
    n, w = scores.shape
    col = torch.arange(w, device=scores.device)
    inside = col[None, :] < lengths.to(scores.device)[:, None]
    key = torch.where(inside, sglang_order(scores) * (1 << 31) + (w - col), -1)  # col < 2³¹
    width = min(k, w)
    top = key.topk(width, dim=1).values
    picked = torch.where(top >= 0, w - (top % (1 << 31)), -1)
    big = torch.iinfo(torch.int64).max
    out = torch.where(picked >= 0, picked, big).sort(dim=1).values
    out = torch.where(out == big, -1, out)
    if width < k:
        out = torch.cat([out, out.new_full((n, k - width), -1)], dim=1)
    return out


def ties_at_cut(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose top-k is decided by a tie rule: bool ``[n]``, True where row ``i`` has more than
    ``k`` positions (``< lengths[i]``) and its ``k``-th and ``(k+1)``-th best keys
    (:func:`sglang_order`) are equal, so the kernel's atomics pick among them."""
    n, w = scores.shape
    if k >= w:
        return torch.zeros(n, dtype=torch.bool, device=scores.device)
    col = torch.arange(w, device=scores.device)
    inside = col[None, :] < lengths.to(scores.device)[:, None]
    key = torch.where(inside, sglang_order(scores), -1)
    top = key.topk(k + 1, dim=1).values
    return (top[:, k - 1] == top[:, k]) & (top[:, k] >= 0)


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
