"""Lightning-indexer scores: ``s[i, t] = Σ_h w[i, h] · relu(scale · q[i, h] · k[t])``."""

from __future__ import annotations

import torch

# Key blocks bound the [n · H_I, block] intermediate (256 rows × 64 heads × 4096 keys = 256 MiB).
_KEY_BLOCK = 4096


def index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """Score every key for every query row.

    Args:
        q: ``[n, H_I, D]`` index queries (rope already applied to their first rope dims).
        weights: ``[n, H_I]`` per-row head weights (the model's ``weights_proj · H_I**-0.5``).
        keys: ``[T, D]`` index keys.
        scale: ``D ** -0.5``; applied before the ReLU, as the model does.

    Returns:
        float32 ``[n, T]``. No masking: the caller decides which keys a row may see.
    """
    n, heads, d = q.shape
    assert weights.shape == (n, heads), f"{weights.shape=} vs {q.shape=}"
    assert keys.dim() == 2 and keys.shape[1] == d, f"{keys.shape=} vs {q.shape=}"
    qf = q.float().reshape(n * heads, d)
    w = weights.float().unsqueeze(1)  # [n, 1, H_I]
    out = torch.empty(n, keys.shape[0], dtype=torch.float32, device=q.device)
    for start in range(0, keys.shape[0], _KEY_BLOCK):
        kb = keys[start : start + _KEY_BLOCK].float()
        s = torch.relu((qf @ kb.T) * scale).view(n, heads, -1)  # [n, H_I, b]
        out[:, start : start + kb.shape[0]] = torch.bmm(w, s).squeeze(1)
    return out
