"""The indexer's fp8 arithmetic, as DeepSeek's V3.2 inference code and SGLang's NSA backend do it.

Both rotate index queries and keys by a normalised Hadamard matrix (``rotate_activation``), round
the result to bf16, and quantise each 128-wide block to float8 e4m3 with one float32 scale,
``amax`` floored at 1e-4 over 448. SGLang 0.5.10 on CUDA scales the two sides differently:
queries go through ``act_quant`` with ``scale_fmt = "ue8m0"`` (the scale rounded up to a power of
two), keys through its fused index-cache store (``jit_kernel/csrc/nsa/fused_store_index_cache.cuh``:
"use normal fp32 scale", values times ``1 / scale``). The rotation is orthogonal, so without
quantisation scores are unchanged; with it, a key's fp8 rounding depends on the rotation, and
which keys make the top-k depends on that rounding. A corpus served to an SGLang fleet is
therefore prefilled with this arithmetic (``ModelConfig.index_arith = "fp8"``), so that its
selections are the fleet's.
"""

from __future__ import annotations

from functools import cache

import torch

FP8_MAX = 448.0  # float8_e4m3fn
AMAX_FLOOR = 1e-4  # act_quant's clamp


@cache
def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * d**-0.5


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dim (a power of two), ``H`` the Sylvester Hadamard matrix scaled by
    ``d ** -0.5`` (symmetric and orthogonal), in float32; fast-hadamard-transform's order."""
    d = x.shape[-1]
    assert d > 0 and d & (d - 1) == 0, f"Hadamard needs a power-of-two width, got {d}"
    return x.float() @ _sylvester(d).to(x.device)


def quantize(x: torch.Tensor, ue8m0: bool, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 values ``[..., d]`` and float32 scales ``[..., d / block]``: ``act_quant``'s
    power-of-two scales under ``ue8m0``, else the fused key store's plain ones (``x · (1 /
    scale)``, which can round differently from ``x / scale``)."""
    d = x.shape[-1]
    assert d % block == 0, f"width {d} is not a multiple of the quant block {block}"
    xb = x.float().unflatten(-1, (d // block, block))
    scale = xb.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xb * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of :func:`quantize` up to its rounding: float32 ``[..., d]``."""
    return (q.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)


def rotate_round(x: torch.Tensor) -> torch.Tensor:
    """What SGLang quantises: the bf16 input rotated, rounded back to bf16 (its kernel's output)."""
    return hadamard(x.to(torch.bfloat16)).to(torch.bfloat16)


def fp8_view(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """``x`` as the fp8 indexer sees it: rotated, rounded to bf16, quantised, dequantised
    (float32); ``ue8m0`` for queries, not for keys (see the module's note). Dot products of two
    such views are the fp8 kernel's, up to summation order."""
    return dequantize(*quantize(rotate_round(x), ue8m0))
