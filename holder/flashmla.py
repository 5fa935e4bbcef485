"""FlashMLA's bf16 sparse kernel behind the ``partial_attention`` contract.

``sgl_kernel.flash_mla.flash_mla_sparse_fwd`` (sglang-kernel 0.4.6, SM90) computes sparse MLA
attention with:

- q ``[s_q, h_q, 576]`` bf16 with h_q ∈ {64, 128}: fewer heads are zero-padded up to 64 (65…127
  up to 128). The kernel's time is set by the gathered KV bytes and the 64-head MMA tile, so a
  16-head request costs what a 64-head one does: 4× the FLOPs it needs (bench part 1 measures it
  next to Triton, which runs the real head count);
- kv ``[s_kv, 1, 576]`` bf16: the frame pool viewed with one KV head;
- indices ``[s_q, 1, topk]`` int32 with topk a multiple of 128: frame-local rows, padded with -1;
- it returns ``(out [s_q, h_q, 512] bf16, max_logits, lse [s_q, h_q] fp32)``. The LSE is base 2
  in 0.4.6 and natural log in later FlashMLA, and a row with no valid index may come back as
  +inf: the base is detected once per process on a probe against the torch reference and
  normalised to natural log, and empty rows are set to O = 0, LSE = -inf here, never trusted.

A pool of fp8 rows (uint8 ``[N, 656]``, ``corpusd/model/fp8_cache.py``) goes to FlashMLA's fp8
sparse decode instead: ``corpusd/model/flashmla_fp8.py``, shared with the SGLang plugin's device
path, given this module's one-launch index preparation.
"""

from __future__ import annotations

from functools import cache

import torch

from corpusd.model import flashmla_fp8
from corpusd.model.flashmla_fp8 import D_QK, D_V, pad_heads, padded_topk
from corpusd.model.partial import partial_attention


@cache
def _sparse_fwd():
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd


def importable() -> bool:
    try:
        _sparse_fwd()
        flashmla_fp8._decode_fwd()
    except Exception:
        return False
    return True


def usable(device: str) -> bool:
    """SM90 (H100/H200) with sgl_kernel's FlashMLA ops importable."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    dev = torch.device(device)
    return torch.cuda.get_device_capability(dev)[0] == 9 and importable()


def fits(dtype: torch.dtype, d: int, d_v: int) -> bool:
    return dtype == torch.bfloat16 and d == D_QK and d_v == D_V


def _padded(
    q: torch.Tensor, indices: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both kernels take: q with its heads zero-padded to 64 or 128, and the indices
    padded to a multiple of TOPK_ALIGN with -1 for unused (``prep_sparse_indices``: [n, 1, kp]),
    with each row's count of valid ones."""
    idx, count = _prep(indices, rows, padded_topk(indices.shape[1]))
    return pad_heads(q), idx, count


def _raw(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad heads and top-k, call the kernel: (O [n, h, 512], raw lse [n, h], valid count [n])."""
    h, d = q.shape[1], q.shape[2]
    q, idx, count = _padded(q, indices, kv.shape[0])
    out, _, lse = _sparse_fwd()(q, kv.view(kv.shape[0], 1, d), idx, scale, D_V)
    return out[:, :h], lse[:, :h], count


@cache
def lse_to_natural(device: str) -> float:
    """Factor that turns this build's LSE into natural log: 1.0 or ln 2. Detected once on a probe
    (random q and kv, every index valid) against the torch reference; raises RuntimeError when
    the kernel's LSE matches neither base (a build that changed its contract)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 64, D_QK, generator=g, device=device).bfloat16()
    kv = torch.randn(256, D_QK, generator=g, device=device).bfloat16()
    idx = torch.randperm(256, generator=g, device=device)[:128].repeat(2, 1)
    scale = D_QK**-0.5
    _, lse, _ = _raw(q, kv, idx, scale)
    _, ref = partial_attention(q.float(), kv.float(), idx, scale, D_V)
    return flashmla_fp8.lse_base(lse, ref, "FlashMLA's lse")


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
    n, h, d = q.shape
    if kv.dtype == torch.uint8:
        return _fp8_partial(q, kv, indices, scale, d_v)
    assert fits(q.dtype, d, d_v) and kv.dtype == q.dtype, (
        f"FlashMLA needs bf16 q/kv of width {D_QK} and d_v {D_V}: {q.dtype=} {kv.dtype=} {d=} "
        f"{d_v=}; use the triton kernel for other shapes"
    )
    assert kv.is_contiguous(), "FlashMLA reads the pool as [N, 1, 576]: pass a contiguous pool"
    if n == 0:
        return q.new_empty(0, h, D_V), torch.empty(0, h, device=q.device)
    factor = lse_to_natural(str(q.device))
    out, lse, count = _raw(q, kv, indices, scale)
    empty = (count == 0)[:, None]  # [n, 1]
    lse = torch.where(empty, float("-inf"), lse.float() * factor)
    out = out.contiguous()  # a copy only when heads were padded
    return out.masked_fill_(empty[..., None], 0.0), lse


def _fp8_partial(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return flashmla_fp8.fp8_sparse_partial(q, kv, indices, scale, d_v, prep=_prep)


def _prep(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashmla_fp8.Prep`` in one Triton launch (torch's takes four)."""
    from holder.triton_mla import prep_sparse_indices

    idx, count = prep_sparse_indices(indices, n_kv, kp)
    return idx, count
