"""FlashMLA's fp8 latent-cache row (656 bytes per token): quantize, dequantize, and the torch
reference over it (the ``torch`` kernel's fp8 half). The constants live in ``formats``.

The layout is the one SGLang stores for DeepSeek-V3.2 with ``--kv-cache-dtype fp8_e4m3`` and
FlashMLA's sparse decode reads (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=…)``,
"V32_FP8Sparse"). One row, little-endian, no padding::

    bytes   0 … 511   c_KV (the "nope" part, kv_lora_rank 512) as float8_e4m3fn, in 4 tiles of
                      128 values
    bytes 512 … 527   4 float32 scales, one per tile: value ≈ fp8 · scale (scale = amax / 448)
    bytes 528 … 655   k_pe (the rope part, 64 values) as bfloat16, not quantized

Quantization follows SGLang's ``quantize_k_cache`` (``nsa/quant_k_cache.py``, the Triton kernel
it runs by default): per tile ``s = max|x| / 448`` in float32, ``fp8 = clamp(x · (1/s), ±448)``
rounded to nearest even. One deliberate difference: an all-zero tile (the zero padding rows of a
corpus's last page) stores scale 0 and zero codes, where SGLang's ``x · (1/0)`` writes NaN codes;
such rows are never attended.

Dequantization follows FlashMLA's kernel, not its test's float32 reference: the scale is rounded
to bfloat16 and each value is ``bf16(fp8) · bf16(scale)`` rounded to bfloat16
(``cvt_fp8x8_bf16x8`` in ``csrc/sm90/decode/sparse_fp8/components/dequant.h``). Every corpusd
kernel over fp8 pages (this reference, Triton, FlashMLA) attends exactly these values, so the
route, fetch and monolithic paths agree on the keys.
"""

from __future__ import annotations

import torch

from corpusd.kernels.formats import (
    D_QK,
    D_ROPE,
    FP8_MAX,
    N_TILES,
    ROPE_AT,
    ROW_BYTES,
    SCALE_AT,
    TILE,
)
from corpusd.kernels.formats import D_V as D_NOPE
from corpusd.kernels.reference import PartialOut, partial_attention


def check_layout(kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    """Raise ValueError, naming the field, unless a model's latent row fits the fp8 layout
    (kv_lora_rank 512, qk_rope_head_dim 64). A plain ValueError: the kernel package imports
    nothing of ``corpusd.model`` (which imports it), and the CLI answers any ValueError as bad
    input."""
    for name, got, want in (
        ("kv_lora_rank", kv_lora_rank, D_NOPE),
        ("qk_rope_head_dim", qk_rope_head_dim, D_ROPE),
    ):
        if got != want:
            raise ValueError(
                f"the fp8_e4m3 page format needs {name} {want} (FlashMLA's 656-byte row), "
                f"this model has {name} {got}; pin it with --kv-format plain"
            )


def quantize(rows: torch.Tensor) -> torch.Tensor:
    """Latent rows → fp8 rows.

    Args:
        rows: ``[N, 576]`` float32 or bfloat16 (``c_KV ‖ k_pe``), finite.

    Returns:
        uint8 ``[N, 656]`` on ``rows``' device (layout in the module docstring). A float32 row's
        rope part is rounded to bfloat16 (nearest even); its tiles are scaled from float32.
    """
    n, d = rows.shape
    assert d == D_QK, f"fp8 rows quantize [N, {D_QK}] latent rows, got {list(rows.shape)}"
    assert rows.dtype in (torch.float32, torch.bfloat16), f"{rows.dtype=}"
    nope = rows[:, :D_NOPE].float().reshape(n, N_TILES, TILE)
    scale = nope.abs().amax(dim=-1) / FP8_MAX  # [N, 4] float32, as SGLang's kernel
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)  # an all-zero tile: codes 0, scale 0
    codes = (nope * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(n, ROW_BYTES, dtype=torch.uint8, device=rows.device)
    out[:, :D_NOPE] = codes.reshape(n, D_NOPE).view(torch.uint8)
    out[:, SCALE_AT:ROPE_AT] = scale.contiguous().view(torch.uint8)
    out[:, ROPE_AT:] = rows[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 rows ``[N, 656]`` uint8 → (codes float32 ``[N, 4, 128]``, scales float32 ``[N, 4]``,
    rope bfloat16 ``[N, 64]``), exactly as stored."""
    n, w = packed.shape
    assert w == ROW_BYTES and packed.dtype == torch.uint8, f"{packed.shape=} {packed.dtype=}"
    codes = packed[:, :D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[:, SCALE_AT:ROPE_AT].contiguous().view(torch.float32)
    rope = packed[:, ROPE_AT:].contiguous().view(torch.bfloat16)
    return codes.reshape(n, N_TILES, TILE), scales, rope


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 rows → latent rows in FlashMLA's kernel arithmetic (module docstring).

    Args:
        packed: uint8 ``[N, 656]``.
        dtype: float32 or bfloat16 for the result; every value is a bfloat16 value, so both hold
            the same numbers.

    Returns:
        ``[N, 576]`` in ``dtype`` (``c_KV ‖ k_pe``).
    """
    codes, scales, rope = unpack(packed)
    s = scales.to(torch.bfloat16).float()
    # fp8 (4 significant bits) × bf16 (8) is exact in float32: one rounding, to bf16, as in the
    # kernel's bf16 multiply
    nope = (codes * s[..., None]).to(torch.bfloat16).reshape(-1, D_NOPE)
    return torch.cat([nope, rope], dim=1).to(dtype)


def fp8_partial_attention(
    q: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    """``partial_attention`` over fp8 rows: the selected rows are dequantized (``dequantize``),
    then attended exactly in float32.

    Args:
        q: ``[n, h, 576]`` float32 or bfloat16.
        packed: uint8 ``[N, 656]`` pool rows.
        indices: int32/int64 ``[n, k]`` rows of ``packed``; ``-1`` = unused.
        scale: softmax scale; d_v: 512.

    Returns:
        O ``[n, h, 512]`` in q's dtype, LSE float32 ``[n, h]`` natural log; a row with no valid
        index has O = 0, LSE = -inf.

    Raises:
        IndexError: an index ``>= N``.
    """
    assert q.shape[-1] == D_QK and d_v == D_NOPE, f"{q.shape=} {d_v=}"
    assert indices.dim() == 2 and indices.shape[0] == q.shape[0], f"{indices.shape=} {q.shape=}"
    if indices.numel() and int(indices.max()) >= packed.shape[0]:
        raise IndexError(f"index {int(indices.max())} out of range for {packed.shape[0]} rows")
    valid = indices >= 0
    used, local = torch.unique(indices[valid], return_inverse=True)
    rows = dequantize(packed[used], torch.float32)  # only the rows some query selected
    remapped = torch.full_like(indices, -1, dtype=torch.int64)
    remapped[valid] = local
    return partial_attention(q, rows, remapped, scale, d_v)
