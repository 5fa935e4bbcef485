"""Sparse absorbed-MLA partial attention in Triton over plain rows, for any head count: the
``triton`` kernel of the registry for bf16/fp16/fp32 pools; and FlashMLA's index preparation in
one launch.

Same contract as ``corpusd.kernels.reference.partial_attention``: every query row attends over
its own selected pool rows; returns O and the natural-log LSE, with O = 0 and LSE = -inf for a
row with no valid index. Where FlashMLA's kernel needs 64 or 128 heads and top-k a multiple of
128, this one takes h ≥ 1 and any k. The program's prologue, online softmax, epilogue, split-k
merge and launch plan are ``triton_common``'s, shared with ``triton_fp8``; here only how a block
of plain rows is loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corpusd.kernels.reference import PartialOut
from corpusd.kernels.triton_common import (
    DOT_F32,
    LOG2E,
    block_rows,
    init_softmax,
    load_query,
    online_block,
    pow2,
    program_heads,
    run_split,
    store_partial,
)


@triton.jit
def _kv_block(q_nope, q_pe, kv_ptr, r, valid, s_kvn, dv, dp, vmask, pmask, scale2, m, l_sum, acc,
              D_V: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """One block of gathered pool rows ``r`` (``valid`` masked) into the online softmax."""
    kv_row = kv_ptr + r * s_kvn
    k_nope = tl.load(kv_row[:, None] + dv[None, :], mask=valid[:, None] & vmask[None, :],
                     other=0.0)  # fmt: skip
    k_pe = tl.load(kv_row[:, None] + D_V + dp[None, :], mask=valid[:, None] & pmask[None, :],
                   other=0.0)  # fmt: skip
    if DOT_F32:
        k_nope = k_nope.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    return online_block(q_nope, q_pe, k_nope, k_pe, valid, scale2, m, l_sum, acc)


@triton.jit
def _partial_kernel(
    q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr,
    n_kv, k, k_per_split, scale2, h,
    s_qn, s_qh, s_kvn, s_in, s_on, s_os, s_oh, s_ln, s_ls,
    D_V: tl.constexpr, D_PE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_PE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, OUT_BASE2: tl.constexpr,
    DOT_F32: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):  # fmt: skip
    row, split, heads, hmask = program_heads(h, BLOCK_H)
    dv = tl.arange(0, BLOCK_V)
    dp = tl.arange(0, BLOCK_PE)
    vmask = dv < D_V
    pmask = dp < D_PE
    q_nope, q_pe = load_query(q_ptr, row, heads, hmask, s_qn, s_qh, dv, dp, vmask, pmask, D_V,
                              DOT_F32)  # fmt: skip
    m, l_sum, acc = init_softmax(BLOCK_H, BLOCK_V)
    lo = split * k_per_split
    for start in range(0, k_per_split, BLOCK_N):
        r, valid = block_rows(idx_ptr, row, s_in, lo, start, k, k_per_split, n_kv, BLOCK_N)
        # SKIP_EMPTY (a compile-time choice: the default kernel has no branch in its loop): a
        # block with no valid index leaves the softmax state as it is, so its loads and dots are
        # skipped (for compacted lists: valid first, -1 after). Off by default: the branch
        # measured slower than it saves on H200 (docs/gpu.md).
        if SKIP_EMPTY:
            if tl.max(valid.to(tl.int32), 0) > 0:
                m, l_sum, acc = _kv_block(q_nope, q_pe, kv_ptr, r, valid, s_kvn, dv, dp, vmask,
                                          pmask, scale2, m, l_sum, acc, D_V, DOT_F32)  # fmt: skip
        else:
            m, l_sum, acc = _kv_block(q_nope, q_pe, kv_ptr, r, valid, s_kvn, dv, dp, vmask, pmask,
                                      scale2, m, l_sum, acc, D_V, DOT_F32)  # fmt: skip
    store_partial(acc, m, l_sum, o_ptr, lse_ptr, row, split, heads, dv, s_on, s_os, s_oh, s_ln,
                  s_ls, hmask[:, None] & vmask[None, :], hmask, OUT_BASE2)  # fmt: skip


def triton_partial_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    d_v: int,
    *,
    block_h: int | None = None,
    block_n: int = 64,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    out_dtype: torch.dtype | None = None,
    skip_empty: bool = False,
) -> PartialOut:
    """Sparse absorbed-MLA partial attention (the ``partial_attention`` contract).

    Args:
        q: ``[n, h, d]`` bf16/fp16/fp32, any h ≥ 1; last dim contiguous.
        kv: ``[N, d]`` same dtype as q; the first ``d_v`` columns are the values.
        indices: int32/int64 ``[n, k]``; ``-1`` (or any value outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: value width (512 for V3.2).
        block_h / block_n / splits / num_warps / num_stages: tuning; ``None`` = ``plan``.
        out_dtype: O's dtype (default q's). ``torch.float32`` keeps the accumulator unrounded,
            for a caller that merges this partial with others before rounding once (the SGLang
            plugin's corpus partial: a bf16 O would be rounded twice).
        skip_empty: skip blocks of ``block_n`` indices that are all unused (a compacted list's
            tail). The same result; measured slower on H200 at 32 rows × 128 heads.

    Returns:
        O ``[n, h, d_v]`` in ``out_dtype`` and LSE ``[n, h]`` float32, natural log; rows with no
        valid index get O = 0, LSE = -inf. Unlike the reference, an index ``>= N`` is not an
        error here but an unused slot: the caller validates rows (``FramePool.check_rows``).
    """
    n, h, d = q.shape
    assert kv.dim() == 2 and kv.shape[1] == d and kv.dtype == q.dtype, f"{kv.shape=} {q.shape=}"
    assert indices.dim() == 2 and indices.shape[0] == n, f"{indices.shape=} vs {q.shape=}"
    assert 0 < d_v < d, f"{d_v=} must be below the query width {d}"
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    consts = {
        "D_V": d_v,
        "D_PE": d - d_v,
        "BLOCK_V": pow2(d_v),
        "BLOCK_PE": pow2(d - d_v),
        "DOT_F32": DOT_F32,
        "SKIP_EMPTY": skip_empty,
    }

    def launch(grid: tuple[int, ...], per: int, o_: torch.Tensor, lse_: torch.Tensor,
               out_strides: tuple[int, ...], base2: bool, meta: dict) -> None:  # fmt: skip
        _partial_kernel[grid](
            q, kv, indices, o_, lse_, kv.shape[0], k, per, scale * LOG2E, h,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), *out_strides,
            OUT_BASE2=base2, **consts, **meta,
        )  # fmt: skip

    k = indices.shape[1]
    return run_split(launch, q, k, d_v, block_h, block_n, splits, num_warps, num_stages,
                     lambda bh: 4 if bh == 32 else 8, out_dtype)  # fmt: skip


@triton.jit
def _prep_kernel(idx_ptr, out_ptr, count_ptr, n_kv, k, kp, s_in, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    total = tl.zeros([BLOCK], tl.int32)
    for start in range(0, kp, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(idx_ptr + row * s_in + cols, mask=cols < k, other=-1).to(tl.int64)
        ok = (v >= 0) & (v < n_kv)
        tl.store(out_ptr + row * kp + cols, tl.where(ok, v, -1).to(tl.int32), mask=cols < kp)
        total += ok.to(tl.int32)
    tl.store(count_ptr + row, tl.sum(total, 0))


def prep_sparse_indices(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, ...]:
    """One launch instead of five for FlashMLA's index layout: ``indices [n, k]`` (any int) →
    ``(idx [n, 1, kp] int32 with -1 for unused, padding and out-of-pool slots, valid count
    [n] int32)``."""
    n, k = indices.shape
    assert kp >= k, f"{kp=} < {k=}"
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    out = torch.empty(n, 1, kp, dtype=torch.int32, device=indices.device)
    count = torch.empty(n, dtype=torch.int32, device=indices.device)
    if n:
        _prep_kernel[(n,)](indices, out, count, n_kv, k, kp, indices.stride(0), BLOCK=512)
    return out, count
