"""Sparse absorbed-MLA partial attention in Triton over FlashMLA's fp8 rows, dequantized in-kernel.

Same contract as ``corpusd.model.fp8_cache.fp8_partial_attention`` (and ``partial_attention``):
O and the natural-log LSE, O = 0 and LSE = -inf for a row with no valid index; any head count,
any k. The pool is uint8 ``[N, 656]`` (``corpusd/model/fp8_cache.py``); the kernel reads each
selected row through three views of the same bytes: the 512 fp8 codes (uint8), the 4 float32
tile scales, and the 64 bf16 rope values. A code becomes ``bf16(bf16(fp8) · bf16(scale))``,
FlashMLA's own dequantization, so this kernel attends the very values the torch reference and
FlashMLA's fp8 decode attend; the dot products then run as in ``triton_mla`` (bf16 operands,
float32 accumulation; float32 for float32 queries).

The grid, the split of k over programs and the LSE merge of the splits are ``triton_mla``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corpusd.model.fp8_cache import D_NOPE, D_ROPE, N_TILES, ROPE_AT, ROW_BYTES, SCALE_AT, TILE
from corpusd.model.triton_mla import _DOT_F32, _LOG2E, online_block, run_split, store_partial


@triton.jit
def _round_bf16(x):
    """float32 → the nearest bf16 value (ties to even), kept in float32: explicit integer
    rounding, since Triton's CPU interpreter truncates in ``.to(tl.bfloat16)`` where the GPU
    rounds to nearest. Inputs here are finite."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_partial_kernel(
    q_ptr, k8_ptr, ks_ptr, kr_ptr, idx_ptr, o_ptr, lse_ptr,
    n_kv, k, k_per_split, scale2, h,
    s_qn, s_qh, s_k8, s_ks, s_kr, s_in, s_on, s_os, s_oh, s_ln, s_ls,
    D_V: tl.constexpr, D_PE: tl.constexpr, TILE_W: tl.constexpr, N_TILES: tl.constexpr,
    SCALE_COL: tl.constexpr,
    ROPE_COL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    OUT_BASE2: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < h
    dv = tl.arange(0, D_V)
    dp = tl.arange(0, D_PE)

    q_row = q_ptr + row * s_qn + heads[:, None] * s_qh
    q_nope = tl.load(q_row + dv[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_row + D_V + dp[None, :], mask=hmask[:, None], other=0.0)
    if DOT_F32:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    lo = split * k_per_split
    for start in range(0, k_per_split, BLOCK_N):
        cols = lo + start + tl.arange(0, BLOCK_N)
        cmask = (cols < k) & (start + tl.arange(0, BLOCK_N) < k_per_split)
        idx = tl.load(idx_ptr + row * s_in + cols, mask=cmask, other=-1).to(tl.int64)
        # Out-of-range rows count as unused: the kernel never reads outside the pool.
        valid = (idx >= 0) & (idx < n_kv)
        r = tl.where(valid, idx, 0)
        codes = tl.load(k8_ptr + r[:, None] * s_k8 + dv[None, :], mask=valid[:, None], other=0)
        scales = tl.load(
            ks_ptr + r[:, None] * s_ks + SCALE_COL + tl.arange(0, N_TILES)[None, :],
            mask=valid[:, None],
            other=0.0,
        )  # [BLOCK_N, 4]: one per tile, broadcast over its 128 codes below
        # FlashMLA's dequantization: bf16(fp8) · bf16(scale), rounded to bf16 (the float32
        # product of a 4-bit and an 8-bit significand is exact, so one rounding, as in bf16 mul)
        vals = tl.reshape(
            codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BLOCK_N, N_TILES, TILE_W]
        )
        vals = _round_bf16(vals * _round_bf16(scales)[:, :, None])
        k_nope = tl.reshape(vals, [BLOCK_N, D_V]).to(tl.bfloat16)  # exact: bf16 values
        k_pe = tl.load(kr_ptr + r[:, None] * s_kr + ROPE_COL + dp[None, :], mask=valid[:, None],
                       other=0.0)  # fmt: skip
        k_nope = k_nope.to(q_nope.dtype)
        k_pe = k_pe.to(q_pe.dtype)
        m, l_sum, acc = online_block(q_nope, q_pe, k_nope, k_pe, valid, scale2, m, l_sum, acc)

    o_addr = o_ptr + row * s_on + split * s_os + heads[:, None] * s_oh + dv[None, :]
    lse_addr = lse_ptr + row * s_ln + split * s_ls + heads
    store_partial(acc, m, l_sum, o_addr, lse_addr, hmask[:, None], hmask, OUT_BASE2)


def triton_fp8_partial_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    d_v: int,
    *,
    block_h: int | None = None,
    block_n: int = 32,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed-MLA partial attention over fp8 rows (the ``partial_attention`` contract).

    Args:
        q: ``[n, h, 576]`` bf16 or float32, any h ≥ 1; last dim contiguous.
        kv: uint8 ``[N, 656]`` fp8 rows, contiguous.
        indices: int32/int64 ``[n, k]``; ``-1`` (or any value outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: 512.
        block_h / block_n / splits / num_warps / num_stages: tuning; ``None`` = ``plan``.

    Returns:
        O ``[n, h, 512]`` in q's dtype and LSE ``[n, h]`` float32, natural log; rows with no
        valid index get O = 0, LSE = -inf. An index ``>= N`` is an unused slot, not an error
        (the caller validates rows).
    """
    n, h, d = q.shape
    assert d == D_NOPE + D_ROPE and d_v == D_NOPE, f"fp8 rows hold 512 + 64: {q.shape=} {d_v=}"
    assert kv.dtype == torch.uint8 and kv.dim() == 2 and kv.shape[1] == ROW_BYTES, (
        f"{kv.dtype=} {kv.shape=}: pass fp8 rows, uint8 [N, {ROW_BYTES}]"
    )
    assert kv.is_contiguous(), "the fp8 pool is read through dtype views: pass it contiguous"
    assert indices.dim() == 2 and indices.shape[0] == n, f"{indices.shape=} vs {q.shape=}"
    q = q if q.stride(-1) == 1 else q.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    scales, rope = kv.view(torch.float32), kv.view(torch.bfloat16)  # [N, 164], [N, 328]
    consts = {
        "D_V": d_v,
        "D_PE": D_ROPE,
        "TILE_W": TILE,
        "N_TILES": N_TILES,
        "SCALE_COL": SCALE_AT // 4,
        "ROPE_COL": ROPE_AT // 2,
        "DOT_F32": _DOT_F32,
    }

    def launch(grid: tuple[int, ...], per: int, o_: torch.Tensor, lse_: torch.Tensor,
               out_strides: tuple[int, ...], base2: bool, meta: dict) -> None:  # fmt: skip
        _fp8_partial_kernel[grid](
            q, kv, scales, rope, indices, o_, lse_, kv.shape[0], k, per, scale * _LOG2E, h,
            q.stride(0), q.stride(1), kv.stride(0), scales.stride(0), rope.stride(0),
            indices.stride(0), *out_strides, OUT_BASE2=base2, **consts, **meta,
        )  # fmt: skip

    k = indices.shape[1]
    return run_split(launch, q, k, d_v, block_h, block_n, splits, num_warps, num_stages,
                     lambda bh: 4 if bh <= 32 else 8)  # fmt: skip
