"""Lightning-indexer scores: ``s[i, t] = Σ_h w[i, h] · relu(scale · q[i, h] · k[t])``."""

from __future__ import annotations

import torch

from indexer.fp8 import fp8_view

ARITHS = ("exact", "fp8")

# Key blocks bound the [n · H_I, block] intermediate (256 rows × 64 heads × 1024 keys = 64 MiB),
# allocated once per call: fresh multi-MiB temporaries per block cost page faults (sys time).
_KEY_BLOCK = 1024


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    arith: str = "exact",
    limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score every key for every query row.

    Args:
        q: ``[n, H_I, D]`` index queries (rope already applied to their first rope dims).
        weights: ``[n, H_I]`` per-row head weights (the model's ``weights_proj · H_I**-0.5``).
        keys: ``[T, D]`` index keys.
        scale: ``D ** -0.5`` (> 0); applied before the ReLU, as the model does.
        arith: ``"exact"`` (float32, as transformers) or ``"fp8"``: q and keys as the fp8
            indexer of DeepSeek's inference code and SGLang sees them (:mod:`indexer.fp8`).
        limit: optional int ``[n]``: row ``i``'s keys at positions ``>= limit[i]`` score
            ``-inf`` (causality; ``select_topk`` never picks them).

    Returns:
        float32 ``[n, T]``. Without ``limit`` no masking: the caller decides which keys a row
        may see.
    """
    n, heads, d = q.shape
    assert scale > 0, f"{scale=}"
    assert weights.shape == (n, heads), f"{weights.shape=} vs {q.shape=}"
    assert keys.dim() == 2 and keys.shape[1] == d, f"{keys.shape=} vs {q.shape=}"
    assert arith in ARITHS, f"{arith=}"
    if arith == "fp8":
        q, keys = fp8_view(q, ue8m0=True), fp8_view(keys, ue8m0=False)
    # relu(s·x) == s·relu(x) for s > 0 up to rounding; scaling q once saves a pass over the
    # [n·H_I, block] product, which (with the ReLU) is memory-bound on CPU.
    qf = (q.float() * scale).reshape(n * heads, d)
    w = weights.float().unsqueeze(1)  # [n, 1, H_I]
    t = keys.shape[0]
    out = torch.empty(n, t, dtype=torch.float32, device=q.device)
    buf = torch.empty(n * heads * min(t, _KEY_BLOCK), dtype=torch.float32, device=q.device)
    for start in range(0, t, _KEY_BLOCK):
        kb = keys[start : start + _KEY_BLOCK].float()
        b = kb.shape[0]
        s = buf[: n * heads * b].view(n * heads, b)
        torch.mm(qf, kb.T, out=s)
        torch.relu_(s)
        torch.bmm(w, s.view(n, heads, b), out=out[:, start : start + b].unsqueeze(1))
    if limit is not None:  # only columns past the lowest limit can be masked
        lo = max(0, min(t, int(limit.min()))) if n else t
        pos = torch.arange(lo, t, device=out.device)
        out[:, lo:].masked_fill_(pos[None, :] >= limit[:, None], float("-inf"))
    return out
