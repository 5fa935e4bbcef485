"""The exact LSE merge of partial attentions, in torch: the one definition.

``L = logsumexp_i L_i``, ``O = Σ_i exp(L_i − L) · O_i``; an empty part has ``L_i = -inf`` and
weight 0, and a row empty in every part stays empty (O = 0, L = -inf). The order of the parts
does not matter. The fan-out's groups, the worker's own and corpus partials, the SGLang plugin's
local and corpus partials (``requester/sglang/lse.py``) and FlashMLA's split rows all merge
here. Two parts on a GPU go through one fused Triton kernel of the same arithmetic
(``merge_triton.py``, tested against these torch ops in Triton's interpreter); Triton's split-k
merge inside ``triton_common._merge_kernel`` is the same arithmetic in base 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from corpusd.kernels.reference import PartialOut


def merge_stacked(o: torch.Tensor, lse: torch.Tensor, dim: int = 0) -> PartialOut:
    """Merge the parts stacked along ``dim``: ``o [..., m, ..., d_v]`` (``m`` at ``dim`` of
    ``lse``'s shape plus a trailing value dim), ``lse`` float ``[..., m, ...]`` natural log.
    Returns (O float32, L float32) with ``dim`` removed; graph-safe (no host sync)."""
    lses = lse.float()
    total = torch.logsumexp(lses, dim=dim)  # -inf where every part is empty
    ref = torch.where(torch.isinf(total), 0.0, total).unsqueeze(dim)
    w = torch.exp(lses - ref)  # 0 for -inf parts
    return (w[..., None] * o.float()).sum(dim=dim), total


def merge_partials(parts: Sequence[PartialOut]) -> PartialOut:
    """Exact online-softmax merge of ``parts``.

    Args:
        parts: ``(O_i [n, h, d_v], L_i [n, h])``, L natural log, -inf for an empty row; the
            O's may differ in dtype.

    Returns:
        ``(O, L)``: O in the first part's dtype, L float32; rows empty in every part get O = 0,
        L = -inf. Raises ValueError when ``parts`` is empty or shapes disagree.
    """
    if not parts:
        raise ValueError("merge_partials needs at least one partial")
    shapes = {(tuple(o.shape), tuple(lse.shape)) for o, lse in parts}
    if len(shapes) != 1:
        raise ValueError(f"partials disagree in shape: {sorted(shapes)}")
    if len(parts) == 2 and all(o.is_cuda for o, _ in parts):
        from corpusd.kernels import merge_triton  # (lazily: CPU processes never load Triton)

        if merge_triton.usable(parts[0][0]):  # the same arithmetic in one kernel
            (oa, la), (ob, lb) = parts
            return merge_triton.merge2(oa, la, ob, lb)
    o, total = merge_stacked(
        torch.stack([o.float() for o, _ in parts]), torch.stack([lse.float() for _, lse in parts])
    )
    return o.to(parts[0][0].dtype), total
