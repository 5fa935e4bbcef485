"""FlashMLA behind the ``partial_attention`` contract, for a holder's pool.

A bf16 pool goes to FlashMLA's sparse kernel (``corpusd/model/flashmla_bf16.py``, shared with
the GPU pin's prefill), a pool of fp8 rows (uint8 ``[N, 656]``, ``corpusd/model/fp8_cache.py``)
to FlashMLA's fp8 sparse decode (``corpusd/model/flashmla_fp8.py``, shared with the SGLang
plugin's device path). Both are given this module's one-launch Triton index preparation.
"""

from __future__ import annotations

import torch

from corpusd.model import flashmla_bf16, flashmla_fp8
from corpusd.model.flashmla_bf16 import fits, lse_to_natural

__all__ = ["fits", "flashmla_partial_attention", "fp8_lse_to_natural", "lse_to_natural"]


def importable() -> bool:
    try:
        flashmla_bf16._sparse_fwd()
        flashmla_fp8._decode_fwd()
    except Exception:
        return False
    return True


def usable(device: str) -> bool:
    """SM90 (H100/H200) with sgl_kernel's FlashMLA ops importable."""
    return flashmla_bf16.usable(device) and importable()


def fp8_lse_to_natural(device: str) -> float:
    """``lse_to_natural`` for the fp8 decode kernel (``flashmla_fp8.lse_to_natural``)."""
    return flashmla_fp8.lse_to_natural(device)


def flashmla_partial_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse partial attention through FlashMLA (the ``partial_attention`` contract).

    Args:
        q: ``[n, h, 576]`` bf16 on an SM90 GPU, 1 ≤ h ≤ 128.
        kv: ``[N, 576]`` bf16 pool rows (contiguous), or fp8 rows: uint8 ``[N, 656]`` with N a
            multiple of 64.
        indices: int ``[n, k]`` pool rows; -1 (or outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: must be 512.

    Returns:
        O ``[n, h, 512]`` bf16, LSE ``[n, h]`` float32 natural log; empty rows O = 0, LSE = -inf.
    """
    if kv.dtype == torch.uint8:
        return flashmla_fp8.fp8_sparse_partial(q, kv, indices, scale, d_v, prep=_prep)
    return flashmla_bf16.sparse_partial(q, kv, indices, scale, d_v, prep=_prep)


def _prep(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashmla_fp8.Prep`` in one Triton launch (torch's takes four)."""
    from corpusd.model.triton_mla import prep_sparse_indices

    idx, count = prep_sparse_indices(indices, n_kv, kp)
    return idx, count
