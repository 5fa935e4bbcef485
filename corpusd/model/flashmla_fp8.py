"""FlashMLA's fp8 sparse decode over 656-byte rows, behind the ``partial_attention`` contract.

Shared by the two processes that attend fp8 pools on a GPU: a holder over its own pool
(``holder/flashmla.py``) and an SGLang worker over a holder's pool mapped by CUDA IPC
(``requester/sglang/device.py``). The kernel is ``flash_mla_with_kvcache(...,
is_fp8_kvcache=True, indices=…)`` as SGLang's ``flashmla_kv`` decode calls it:

- q ``[n, 1, h_p, 576]`` bf16, one query row per batch entry, heads zero-padded to h_p = 64
  (65…128: 128);
- the pool, uint8 ``[N, 656]`` (``fp8_cache``'s row) with N a multiple of 64, viewed as
  ``[N/64, 64, 1, 656]`` float8_e4m3fn (FlashMLA's block is 64 rows);
- indices ``[n, 1, k_p]`` int32, pool rows, -1 unused, k_p a multiple of 128;
- it returns ``(out [n, 1, h_p, 512] bf16, softmax_lse [n, h_p, 1] float32)``; the LSE's base is
  probed once per device against :func:`fp8_partial_attention` (natural log in the builds we
  know) and a row with no valid index is set to O = 0, LSE = -inf here, never trusted.

Graph-safe once :func:`lse_to_natural` has run for the device (outside any capture): every
allocation's size follows from the input shapes, the scheduler metadata is computed on the device
from a constant length, and nothing is read back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import torch

from corpusd.model.fp8_cache import ROW_BYTES, fp8_partial_attention, quantize

D_QK, D_V, TOPK_ALIGN = 576, 512, 128
FP8_BLOCK = 64  # rows of one FlashMLA fp8 cache block

#: ``(indices [n, k], pool rows, k_p) → (idx [n, 1, k_p] int32, -1 unused, valid count [n])``
Prep = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@cache
def _decode_fwd():
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    return flash_mla_with_kvcache, get_mla_metadata


def padded_heads(h: int) -> int:
    assert 0 < h <= 128, f"FlashMLA takes at most 128 heads, got {h=}"
    return 64 if h <= 64 else 128


def padded_topk(k: int) -> int:
    """FlashMLA's top-k width for ``k`` selected rows: a multiple of 128, at least 128."""
    return max(TOPK_ALIGN, math.ceil(k / TOPK_ALIGN) * TOPK_ALIGN)


def pad_heads(q: torch.Tensor) -> torch.Tensor:
    """``q [n, h, d]`` with its heads zero-padded to 64 or 128 (``q`` itself when already)."""
    n, h, d = q.shape
    hp = padded_heads(h)
    if hp == h:
        return q
    qp = q.new_zeros(n, hp, d)
    qp[:, :h] = q
    return qp


def prep_indices(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`Prep` in torch (any device, no host sync): indices outside ``[0, n_kv)`` and the
    padding become -1."""
    n, k = indices.shape
    assert kp >= k, f"{kp=} < {k=}"
    ok = (indices >= 0) & (indices < n_kv)
    idx = torch.where(ok, indices, -1).to(torch.int32)
    if kp > k:
        idx = torch.cat([idx, idx.new_full((n, kp - k), -1)], dim=1)
    return idx[:, None], ok.sum(dim=1, dtype=torch.int32)


def check_pool(kv: torch.Tensor) -> None:
    """Raise ValueError unless ``kv`` is a pool FlashMLA's fp8 decode reads: contiguous uint8
    ``[N, 656]`` with N a multiple of 64."""
    if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != ROW_BYTES:
        raise ValueError(
            f"an fp8 pool is uint8 [rows, {ROW_BYTES}] (FlashMLA's fp8 row), got {kv.dtype} "
            f"{list(kv.shape)}"
        )
    if kv.shape[0] % FP8_BLOCK or not kv.is_contiguous():
        raise ValueError(
            f"FlashMLA reads an fp8 pool as [rows/{FP8_BLOCK}, {FP8_BLOCK}, 1, {ROW_BYTES}]: it "
            f"needs whole {FP8_BLOCK}-row blocks, contiguous; got {kv.shape[0]} rows "
            f"(contiguous: {kv.is_contiguous()})"
        )


def raw(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
    prep: Prep = prep_indices,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Pad heads and top-k, call the kernel: (O ``[n, h, 512]`` bf16, the kernel's LSE ``[n, h]``
    in its own base, valid count ``[n]``)."""
    n, h, d = q.shape
    qp = pad_heads(q).contiguous()  # viewed as [n, 1, hp, d] below
    kp = padded_topk(indices.shape[1])
    idx, count = prep(indices, kv.shape[0], kp)
    hp = qp.shape[1]
    fwd, metadata = _decode_fwd()
    seqlens = torch.full((n,), kp, dtype=torch.int32, device=q.device)
    sched, splits = metadata(seqlens, hp, 1, hp, True, kp)
    blocks = kv.view(torch.float8_e4m3fn).view(kv.shape[0] // FP8_BLOCK, FP8_BLOCK, 1, ROW_BYTES)
    out, lse = fwd(
        q=qp.view(n, 1, hp, d),
        k_cache=blocks,
        block_table=torch.empty((n, 0), dtype=torch.int32, device=q.device),
        cache_seqlens=seqlens,
        head_dim_v=D_V,
        tile_scheduler_metadata=sched,
        num_splits=splits,
        softmax_scale=scale,
        causal=False,
        is_fp8_kvcache=True,
        indices=idx,
    )
    return out[:, 0, :h], lse[:, :h, 0], count


@cache
def lse_to_natural(device: str) -> float:
    """Factor that turns this build's fp8 decode LSE into natural log: 1.0 or ln 2. Probed once
    per device (random q and rows, every index valid) against :func:`fp8_partial_attention`;
    call it before any CUDA graph capture. Raises RuntimeError when the kernel's LSE matches
    neither base (a build that changed its contract)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 64, D_QK, generator=g, device=device).bfloat16()
    kv = quantize(torch.randn(256, D_QK, generator=g, device=device))
    idx = torch.randperm(256, generator=g, device=device)[:128].repeat(2, 1)
    scale = D_QK**-0.5
    _, lse, _ = raw(q, kv, idx, scale)
    _, ref = fp8_partial_attention(q.float(), kv, idx, scale, D_V)
    return lse_base(lse, ref, "FlashMLA's fp8 decode lse")


def lse_base(lse: torch.Tensor, ref: torch.Tensor, kernel: str) -> float:
    """The factor (1.0 or ln 2) that makes a kernel's probe ``lse`` the reference's natural-log
    ``ref``. Raises RuntimeError naming ``kernel`` when neither does."""
    for factor in (1.0, math.log(2.0)):
        if torch.allclose(lse.float() * factor, ref, rtol=1e-3, atol=1e-2):
            return factor
    raise RuntimeError(
        f"{kernel} matches neither natural log nor base 2: {lse[0, :4].tolist()} vs reference "
        f"{ref[0, :4].tolist()}; check the sgl_kernel build"
    )


def fp8_sparse_partial(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
    prep: Prep = prep_indices, factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sparse partial attention over fp8 rows through FlashMLA (``partial_attention``'s
    contract).

    Args:
        q: ``[n, h, 576]`` bf16 on an SM90 GPU, 1 ≤ h ≤ 128.
        kv: uint8 ``[N, 656]`` fp8 rows, N a multiple of 64, contiguous.
        indices: int ``[n, k]`` pool rows; -1 (or outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: must be 512.
        prep: the index preparation (the holder passes its one-launch Triton kernel).
        factor: :func:`lse_to_natural` of q's device, when the caller probed it (a CUDA graph
            capture must not probe); None probes here, once per device.

    Returns:
        O ``[n, h, 512]`` bf16, LSE ``[n, h]`` float32 natural log; empty rows O = 0, LSE = -inf.
    """
    n, h, d = q.shape
    assert q.dtype == torch.bfloat16 and d == D_QK and d_v == D_V, (
        f"FlashMLA's fp8 decode needs bf16 q of width {D_QK} and d_v {D_V}: {q.dtype=} {d=} "
        f"{d_v=}; use the triton kernel for other shapes"
    )
    check_pool(kv)
    if n == 0:
        return q.new_empty(0, h, D_V), torch.empty(0, h, device=q.device)
    factor = lse_to_natural(str(q.device)) if factor is None else factor
    out, lse, count = raw(q, kv, indices, scale, prep)
    empty = (count == 0)[:, None]
    lse = torch.where(empty, float("-inf"), lse.float() * factor)
    return out.contiguous().masked_fill_(empty[..., None], 0.0), lse
