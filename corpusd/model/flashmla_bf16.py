"""FlashMLA's bf16 sparse kernel behind the ``partial_attention`` contract.

Shared by a holder over its bf16 pool (``holder/flashmla.py``, which passes its one-launch
Triton index preparation) and the GPU pin's prefill (``corpusd.model.kernels``).
``sgl_kernel.flash_mla.flash_mla_sparse_fwd`` (sglang-kernel 0.4.6, SM90) takes:

- q ``[s_q, h_q, 576]`` bf16 with h_q ∈ {64, 128}: fewer heads are zero-padded up to 64 (65…127
  up to 128). The kernel's time is set by the gathered KV bytes and the 64-head MMA tile, so a
  16-head request costs what a 64-head one does;
- kv ``[s_kv, 1, 576]`` bf16: the rows viewed with one KV head;
- indices ``[s_q, 1, topk]`` int32 with topk a multiple of 128: rows, padded with -1;
- it returns ``(out [s_q, h_q, 512] bf16, max_logits, lse [s_q, h_q] fp32)``. The LSE is base 2
  in 0.4.6 and natural log in later FlashMLA, and a row with no valid index may come back as
  +inf: the base is detected once per device on a probe against the torch reference and
  normalised to natural log, and empty rows are set to O = 0, LSE = -inf here, never trusted.
"""

from __future__ import annotations

from functools import cache

import torch

from corpusd.model.flashmla_fp8 import D_QK, D_V, Prep, lse_base, pad_heads, padded_topk
from corpusd.model.flashmla_fp8 import prep_indices as torch_prep
from corpusd.model.partial import partial_attention


@cache
def _sparse_fwd():
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd


def importable() -> bool:
    try:
        _sparse_fwd()
    except Exception:
        return False
    return True


def usable(device: str) -> bool:
    """SM90 (H100/H200) with sgl_kernel's FlashMLA sparse op importable."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device))[0] == 9 and importable()


def fits(dtype: torch.dtype, d: int, d_v: int) -> bool:
    return dtype == torch.bfloat16 and d == D_QK and d_v == D_V


def raw(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, prep: Prep = torch_prep
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad heads and top-k, call the kernel: (O [n, h, 512], raw lse [n, h], valid count [n])."""
    h, d = q.shape[1], q.shape[2]
    idx, count = prep(indices, kv.shape[0], padded_topk(indices.shape[1]))
    out, _, lse = _sparse_fwd()(pad_heads(q), kv.view(kv.shape[0], 1, d), idx, scale, D_V)
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
    _, lse, _ = raw(q, kv, idx, scale)
    _, ref = partial_attention(q.float(), kv.float(), idx, scale, D_V)
    return lse_base(lse, ref, "FlashMLA's lse")


def sparse_partial(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
    prep: Prep = torch_prep,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sparse partial attention over bf16 rows through FlashMLA (``partial_attention``'s
    contract).

    Args:
        q: ``[n, h, 576]`` bf16 on an SM90 GPU, 1 ≤ h ≤ 128.
        kv: ``[N, 576]`` bf16 rows, contiguous.
        indices: int ``[n, k]`` rows; -1 (or outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: must be 512.
        prep: the index preparation (the holder passes its one-launch Triton kernel).

    Returns:
        O ``[n, h, 512]`` bf16, LSE ``[n, h]`` float32 natural log; empty rows O = 0, LSE = -inf.
    """
    n, h, d = q.shape
    assert fits(q.dtype, d, d_v) and kv.dtype == q.dtype, (
        f"FlashMLA needs bf16 q/kv of width {D_QK} and d_v {D_V}: {q.dtype=} {kv.dtype=} {d=} "
        f"{d_v=}; use the triton kernel for other shapes"
    )
    assert kv.is_contiguous(), "FlashMLA reads the rows as [N, 1, 576]: pass them contiguous"
    if n == 0:
        return q.new_empty(0, h, D_V), torch.empty(0, h, device=q.device)
    factor = lse_to_natural(str(q.device))
    out, lse, count = raw(q, kv, indices, scale, prep)
    empty = (count == 0)[:, None]  # [n, 1]
    lse = torch.where(empty, float("-inf"), lse.float() * factor)
    out = out.contiguous()  # a copy only when heads were padded
    return out.masked_fill_(empty[..., None], 0.0), lse
