"""What the two Triton partial kernels (``triton_mla``: plain rows, ``triton_fp8``: fp8 rows)
share: the prologue and epilogue of a program, the base-2 online softmax, the split-k merge,
and the launch plan. Each kernel writes only how it loads a block of keys.

Layout: one program per (row, block of ``BLOCK_H`` heads, split of the row's k indices). The
query is split into its value part ``[BLOCK_H, d_v]`` and its rope part ``[BLOCK_H, d - d_v]``;
a gathered key block likewise (the value part serves q·k and p·v, so it is loaded once). The
softmax is online in base 2. When one row alone cannot fill the GPU (decode: few rows, few
heads) the k indices are split over several programs (flash-decoding) and :func:`_merge_kernel`
merges the splits by their LSE, as ``corpusd.kernels.merge.merge_partials`` does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests) multiplies the raw bits of
# bf16 operands in tl.dot; there the tiles are upcast to float32 first. Compiled kernels keep
# bf16 operands and float32 accumulation.
DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def program_heads(h, BLOCK_H: tl.constexpr):
    """This program's (query row, split, head numbers ``[BLOCK_H]``, heads < h)."""
    row = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return row, split, heads, heads < h


@triton.jit
def load_query(q_ptr, row, heads, hmask, s_qn, s_qh, dv, dp, vmask, pmask,
               D_V: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """The row's query for these heads: (value part ``[BLOCK_H, len(dv)]``, rope part
    ``[BLOCK_H, len(dp)]``), 0 outside the masks, float32 when ``DOT_F32``."""
    q_row = q_ptr + row * s_qn + heads[:, None] * s_qh
    q_nope = tl.load(q_row + dv[None, :], mask=hmask[:, None] & vmask[None, :], other=0.0)
    q_pe = tl.load(q_row + D_V + dp[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    if DOT_F32:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_nope, q_pe


@triton.jit
def init_softmax(BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr):
    """An empty running softmax: (max -inf, sum 0, output 0)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    return m, tl.zeros([BLOCK_H], tl.float32), tl.zeros([BLOCK_H, BLOCK_V], tl.float32)


@triton.jit
def block_rows(idx_ptr, row, s_in, lo, start, k, k_per_split, n_kv, BLOCK_N: tl.constexpr):
    """The pool rows of the split's block at ``start``: (row numbers int64 ``[BLOCK_N]``, 0
    where unused, valid). Out-of-range rows count as unused: no kernel reads outside the pool."""
    cols = lo + start + tl.arange(0, BLOCK_N)
    cmask = (cols < k) & (start + tl.arange(0, BLOCK_N) < k_per_split)
    idx = tl.load(idx_ptr + row * s_in + cols, mask=cmask, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < n_kv)
    return tl.where(valid, idx, 0), valid


@triton.jit
def online_block(q_nope, q_pe, k_nope, k_pe, valid, scale2, m, l_sum, acc):
    """One block of keys into a running base-2 online softmax: scores ``[BLOCK_H, BLOCK_N]``
    scaled by ``scale2`` (log2 e folded in), masked where not ``valid``; returns the new (max,
    sum, unnormalised output). A row masked so far keeps max -inf and sum 0 without a NaN."""
    s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))
    s = tl.where(valid[None, :], s * scale2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
    return m_new, l_sum, acc


@triton.jit
def store_partial(acc, m, l_sum, o_ptr, lse_ptr, row, split, heads, dv, s_on, s_os, s_oh,
                  s_ln, s_ls, o_mask, lse_mask, OUT_BASE2: tl.constexpr):  # fmt: skip
    """A split's partial: O = acc / sum (0 where no key was valid) and its LSE (-inf there),
    natural log unless ``OUT_BASE2``."""
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l_sum)))
    lse = lse2 if OUT_BASE2 else lse2 * 0.6931471805599453
    o_addr = o_ptr + row * s_on + split * s_os + heads[:, None] * s_oh + dv[None, :]
    tl.store(o_addr, out.to(o_addr.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr + row * s_ln + split * s_ls + heads, lse, mask=lse_mask)


@triton.jit
def _merge_kernel(
    o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, splits, h,
    s_pn, s_ps, s_ph, s_ln, s_ls, s_on, s_oh,
    D_V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < splits
    lse2 = tl.load(lse_part_ptr + row * s_ln + sp * s_ls + head, mask=smask, other=float("-inf"))
    mx = tl.max(lse2, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse2 - mx_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    empty = total == 0.0
    w = w / tl.where(empty, 1.0, total)
    dv = tl.arange(0, BLOCK_V)
    vmask = dv < D_V
    part = tl.load(
        o_part_ptr + row * s_pn + sp[:, None] * s_ps + head * s_ph + dv[None, :],
        mask=smask[:, None] & vmask[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    lse2 = mx_safe + tl.log2(tl.where(empty, 1.0, total))
    lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
    tl.store(o_ptr + row * s_on + head * s_oh + dv, out.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(lse_ptr + row * h + head, lse)


def pow2(x: int, floor: int = 16) -> int:
    """The power of two at or above ``x``, at least ``floor`` (Triton's block widths)."""
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, x)))))


def plan(
    n: int, h: int, k: int, sms: int, block_h: int | None = None, block_n: int = 64
) -> tuple[int, int, int]:
    """``(block_h, splits, k_per_split)`` for ``n`` rows of ``h`` heads over ``k`` indices on a
    GPU with ``sms`` multiprocessors: split k until there are about two programs per SM, but
    never below 256 indices per split (the merge and the partial writes would then dominate).
    Head blocks of up to 64 (a wider block re-reads each gathered KV tile fewer times; on H200,
    ``bench_gpu single --tune``: 64 rows × 128 heads, 205 µs at 64 vs 247 µs at 32)."""
    bh = block_h or min(64, pow2(h))
    programs = n * triton.cdiv(h, bh)
    splits = 1
    while programs * splits * 2 <= 2 * sms and k // (splits * 2) >= 256:
        splits *= 2
    per = triton.cdiv(triton.cdiv(k, splits), block_n) * block_n
    return bh, triton.cdiv(k, per), per


def run_split(
    launch: Callable[..., None],
    q: torch.Tensor,
    k: int,
    d_v: int,
    block_h: int | None,
    block_n: int,
    splits: int | None,
    num_warps: int | None,
    num_stages: int,
    warps_for: Callable[[int], int],
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch both partial kernels share: the plan (head block, split of the k indices), O
    and LSE allocated, the empty cases, then one ``launch(grid, k_per_split, o, lse, (s_on,
    s_os, s_oh, s_ln, s_ls), base2, meta)`` straight into ``[n, h, d_v]`` when k is not split,
    or into float32 per-split partials in base 2 merged by :func:`_merge_kernel`.
    ``warps_for(block_h)``: the kernel's tuned warps; ``out_dtype``: O's (default q's)."""
    n, h, _ = q.shape
    o = torch.empty(n, h, d_v, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    if n == 0 or h == 0:
        return o, lse
    if k == 0:
        return o.zero_(), lse.fill_(float("-inf"))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    bh, n_split, per = plan(n, h, k, sms, block_h, block_n)
    if splits is not None:
        per = triton.cdiv(triton.cdiv(k, splits), block_n) * block_n
        n_split = triton.cdiv(k, per)
    meta = {"BLOCK_H": bh, "BLOCK_N": block_n, "num_stages": num_stages,
            "num_warps": num_warps or warps_for(bh)}  # fmt: skip
    grid = (n, triton.cdiv(h, bh), n_split)
    if n_split == 1:
        launch(grid, per, o, lse, (o.stride(0), 0, o.stride(1), lse.stride(0), 0), False, meta)
        return o, lse
    o_part = torch.empty(n, n_split, h, d_v, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(n, n_split, h, dtype=torch.float32, device=q.device)
    part_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
                    lse_part.stride(1))  # fmt: skip
    launch(grid, per, o_part, lse_part, part_strides, True, meta)
    _merge_kernel[(n, h)](
        o_part, lse_part, o, lse, n_split, h,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), o.stride(0), o.stride(1),
        D_V=d_v, BLOCK_V=pow2(d_v), BLOCK_S=pow2(n_split, 2), num_warps=4,
    )  # fmt: skip
    return o, lse
