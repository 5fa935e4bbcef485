"""Sparse absorbed-MLA partial attention in Triton over FlashMLA's fp8 rows, dequantized in-kernel.

Same contract as ``corpusd.kernels.fp8_cache.fp8_partial_attention`` (and ``partial_attention``):
O and the natural-log LSE, O = 0 and LSE = -inf for a row with no valid index; any head count,
any k. The pool is uint8 ``[N, 656]`` (``corpusd/kernels/formats.py``); the kernel reads each
selected row through three views of the same bytes: the 512 fp8 codes (uint8), the 4 float32
tile scales, and the 64 bf16 rope values. A code becomes ``bf16(bf16(fp8) · bf16(scale))``,
FlashMLA's own dequantization, so this kernel attends the very values the torch reference and
FlashMLA's fp8 decode attend; the dot products then run as in ``triton_mla`` (bf16 operands,
float32 accumulation; float32 for float32 queries).

The program's prologue, online softmax, epilogue, split-k merge and launch plan are
``triton_common``'s, shared with ``triton_mla``; here only how a block of fp8 rows is loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corpusd.kernels.formats import D_ROPE, N_TILES, ROPE_AT, ROW_BYTES, SCALE_AT, TILE
from corpusd.kernels.formats import D_V as D_NOPE
from corpusd.kernels.reference import PartialOut
from corpusd.kernels.triton_common import (
    DOT_F32,
    LOG2E,
    block_rows,
    init_softmax,
    load_query,
    online_block,
    program_heads,
    run_split,
    store_partial,
)


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
    row, split, heads, hmask = program_heads(h, BLOCK_H)
    dv = tl.arange(0, D_V)
    dp = tl.arange(0, D_PE)
    every_v = dv < D_V  # all True: the widths are powers of two here
    every_p = dp < D_PE
    q_nope, q_pe = load_query(q_ptr, row, heads, hmask, s_qn, s_qh, dv, dp, every_v, every_p, D_V,
                              DOT_F32)  # fmt: skip
    m, l_sum, acc = init_softmax(BLOCK_H, D_V)
    lo = split * k_per_split
    for start in range(0, k_per_split, BLOCK_N):
        r, valid = block_rows(idx_ptr, row, s_in, lo, start, k, k_per_split, n_kv, BLOCK_N)
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

    store_partial(acc, m, l_sum, o_ptr, lse_ptr, row, split, heads, dv, s_on, s_os, s_oh, s_ln,
                  s_ls, hmask[:, None], hmask, OUT_BASE2)  # fmt: skip


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
) -> PartialOut:
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
        "DOT_F32": DOT_F32,
    }

    def launch(grid: tuple[int, ...], per: int, o_: torch.Tensor, lse_: torch.Tensor,
               out_strides: tuple[int, ...], base2: bool, meta: dict) -> None:  # fmt: skip
        _fp8_partial_kernel[grid](
            q, kv, scales, rope, indices, o_, lse_, kv.shape[0], k, per, scale * LOG2E, h,
            q.stride(0), q.stride(1), kv.stride(0), scales.stride(0), rope.stride(0),
            indices.stride(0), *out_strides, OUT_BASE2=base2, **consts, **meta,
        )  # fmt: skip

    k = indices.shape[1]
    return run_split(launch, q, k, d_v, block_h, block_n, splits, num_warps, num_stages,
                     lambda bh: 4 if bh <= 32 else 8)  # fmt: skip
