"""FlashMLA's two sparse kernels behind the ``partial_attention`` contract: the ``flashmla``
kernel of the registry, the GPU pin's prefill attention, and the SGLang plugin's device path.

- **bf16 rows** go to ``sgl_kernel.flash_mla.flash_mla_sparse_fwd`` (sglang-kernel 0.4.6):
  q ``[s_q, h_p, 576]`` bf16, kv ``[s_kv, 1, 576]`` bf16 (the rows viewed with one KV head),
  indices ``[s_q, 1, topk]`` int32 with topk a multiple of 128, -1 padded; it returns
  ``(out [s_q, h_p, 512] bf16, max_logits, lse [s_q, h_p] fp32)``.
- **fp8 rows** (uint8 ``[N, 656]``, ``formats``; N whole 64-row blocks) go to
  ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=…)`` as SGLang's ``flashmla_kv``
  decode calls it: q ``[n, 1, h_p, 576]`` bf16, the pool viewed as ``[N/64, 64, 1, 656]``
  float8_e4m3fn, indices ``[n, 1, k_p]`` int32; it returns ``(out [n, 1, h_p, 512] bf16,
  softmax_lse [n, h_p, 1] float32)``.

Both take heads zero-padded to FlashMLA's tile (:func:`pad_heads`: 64 or 128 on SM90, 128 on
SM100). The kernel's time is set by the gathered KV bytes and the 64-head MMA tile, so a 16-head
request costs what a 64-head one does. The LSE is base 2 in the 0.4.6 sparse kernel and natural
log elsewhere, and a row with no valid index may come back as +inf: the base is detected once
per device and kernel by one probe against the torch reference (:func:`lse_to_natural`) and
normalised to natural log, and empty rows are set to O = 0, LSE = -inf here, never trusted.

Graph-safe once :func:`lse_to_natural` has run for the device (outside any capture): every
allocation's size follows from the input shapes and nothing is read back to the host.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import cache

import torch

from corpusd.kernels.capability import sm_major
from corpusd.kernels.formats import D_QK, D_V, FP8_BLOCK, ROW_BYTES, TOPK_ALIGN, valid_first
from corpusd.kernels.merge import merge_stacked
from corpusd.kernels.reference import PartialOut, partial_attention

#: ``(indices [n, k], pool rows, k_p) → (idx [n, 1, k_p] int32, -1 unused, valid count [n])``
Prep = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@cache
def _sparse_fwd():
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd


@cache
def _decode_fwd():
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    return flash_mla_with_kvcache, get_mla_metadata


def importable() -> bool:
    """Both of sgl_kernel's FlashMLA ops import here."""
    try:
        _sparse_fwd()
        _decode_fwd()
    except Exception:
        return False
    return True


def usable(device: str) -> bool:
    """SM90 (H100/H200) with sgl_kernel's FlashMLA ops importable."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    return sm_major(device) == 9 and importable()


@cache
def takes_lengths() -> bool:
    """The sparse kernel here takes ``topk_length`` (sglang-kernel 0.4.6 does; the build an
    SGLang server brings may not)."""
    try:
        return "topk_length" in inspect.signature(_sparse_fwd()).parameters
    except (ImportError, TypeError, ValueError):
        return False


def lengths_usable(device: str) -> bool:
    """:func:`usable`, with a sparse kernel that takes each row's valid count."""
    return usable(device) and takes_lengths()


def fits(dtype: torch.dtype, d: int, d_v: int) -> bool:
    """A model of ``dtype`` with latent rows ``d`` wide, ``d_v`` values: bf16, 576 / 512 (its
    pool plain or fp8)."""
    return dtype == torch.bfloat16 and d == D_QK and d_v == D_V


# -- the layout FlashMLA reads: heads, top-k, indices, fp8 pools --------------------------------


#: The most heads one FlashMLA call takes (:func:`by_head_groups` runs more per group).
KERNEL_MAX_HEADS = 128


def padded_heads(h: int, sm: int = 9) -> int:
    """FlashMLA's head count for ``h`` heads on an SM ``sm`` GPU: 64 or 128 on SM90, 128 on
    SM100 (its sparse kernels' head tile there). AssertionError past 128 heads."""
    assert 0 < h <= KERNEL_MAX_HEADS, f"FlashMLA takes 1 to 128 heads, got {h=}"
    return 128 if sm >= 10 or h > 64 else 64


def pad_heads(q: torch.Tensor, sm: int | None = None) -> torch.Tensor:
    """``q [n, h, d]`` with its heads zero-padded to :func:`padded_heads` (``q`` itself when
    already there); ``sm``: the GPU's SM major, None reads q's device (9 off CUDA)."""
    n, h, d = q.shape
    hp = padded_heads(h, (sm_major(q.device) or 9) if sm is None else sm)
    if hp == h:
        return q
    qp = q.new_zeros(n, hp, d)
    qp[:, :h] = q
    return qp


def padded_topk(k: int) -> int:
    """FlashMLA's top-k width for ``k`` selected rows: a multiple of 128, at least 128."""
    return max(TOPK_ALIGN, math.ceil(k / TOPK_ALIGN) * TOPK_ALIGN)


def prep_indices(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`Prep` in torch (any device, no host sync): indices outside ``[0, n_kv)`` and the
    padding become -1. ``prep_triton`` does it in one launch."""
    n, k = indices.shape
    assert kp >= k, f"{kp=} < {k=}"
    ok = (indices >= 0) & (indices < n_kv)
    idx = torch.where(ok, indices, -1).to(torch.int32)
    if kp > k:
        idx = torch.cat([idx, idx.new_full((n, kp - k), -1)], dim=1)
    return idx[:, None], ok.sum(dim=1, dtype=torch.int32)


def prep_triton(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`Prep` in one Triton launch (torch's takes four); CUDA only."""
    from corpusd.kernels.triton_mla import prep_sparse_indices

    idx, count = prep_sparse_indices(indices, n_kv, kp)
    return idx, count


def prep_lengths(indices: torch.Tensor, n_kv: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`Prep` for FlashMLA's ``topk_length``: :func:`prep_indices` with each row's valid
    indices moved first (their order kept, ``formats.valid_first``), so the kernel, told each
    row's valid count, walks only those. Exact on any layout (the move is this function's);
    on a row that is valid first already it is a no-op."""
    idx, count = prep_indices(indices, n_kv, kp)
    return valid_first(idx[:, 0])[:, None], count


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


# -- the raw calls: padded in, the kernel's own LSE out ------------------------------------------


def raw_sparse(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
    prep: Prep = prep_indices, lengths: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """bf16 rows: pad heads and top-k, call the kernel: (O ``[n, h, 512]`` bf16, the kernel's
    LSE ``[n, h]`` in its own base, valid count ``[n]``). ``lengths``: pass each row's valid
    count as the kernel's ``topk_length`` (``prep`` must then put the valid indices first:
    :func:`prep_lengths`), so it walks those only, not the whole width."""
    h, d = q.shape[1], q.shape[2]
    idx, count = prep(indices, kv.shape[0], padded_topk(indices.shape[1]))
    # the keyword only when asked: the sgl_kernel an SGLang server loads lacks it
    told = {"topk_length": count} if lengths else {}
    out, _, lse = _sparse_fwd()(pad_heads(q), kv.view(kv.shape[0], 1, d), idx, scale, D_V, **told)
    return out[:, :h], lse[:, :h], count


def raw_fp8(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
    prep: Prep = prep_indices,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp8 rows: pad heads and top-k, call the kernel: (O ``[n, h, 512]`` bf16, the kernel's LSE
    ``[n, h]`` in its own base, valid count ``[n]``)."""
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


# -- the one LSE-base probe ----------------------------------------------------------------------


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


@cache
def lse_to_natural(device: str, fp8: bool = False) -> float:
    """Factor (1.0 or ln 2) that turns the LSE of FlashMLA's sparse kernel (``fp8``: its fp8
    decode) on ``device`` into natural log. Probed once per device and kernel (random q and
    rows, every index valid) against the torch reference; call it before any CUDA graph
    capture. Raises RuntimeError when the LSE matches neither base (a build that changed its
    contract)."""
    from corpusd.kernels.fp8_cache import fp8_partial_attention, quantize

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 64, D_QK, generator=g, device=device).bfloat16()
    rows = torch.randn(256, D_QK, generator=g, device=device)
    idx = torch.randperm(256, generator=g, device=device)[:128].repeat(2, 1)
    scale = D_QK**-0.5
    if fp8:
        kv = quantize(rows)
        _, lse, _ = raw_fp8(q, kv, idx, scale)
        _, ref = fp8_partial_attention(q.float(), kv, idx, scale, D_V)
        return lse_base(lse, ref, "FlashMLA's fp8 decode lse")
    kv = rows.bfloat16()
    _, lse, _ = raw_sparse(q, kv, idx, scale)
    _, ref = partial_attention(q.float(), kv.float(), idx, scale, D_V)
    return lse_base(lse, ref, "FlashMLA's sparse lse")


def to_natural(lse: torch.Tensor, base2: bool) -> torch.Tensor:
    """A kernel's LSE as float32 natural log with empty rows ``-inf``: base 2 is scaled by ln 2;
    ``+inf`` (FlashMLA's empty row) and NaN become ``-inf``."""
    out = lse.float() * math.log(2.0) if base2 else lse.float()
    return torch.where(torch.isnan(out) | (out == math.inf), -math.inf, out)


def sparse_lse_base2(device: str) -> bool:
    """Whether FlashMLA's sparse kernel returns base-2 LSE on ``device`` (:func:`lse_to_natural`),
    in the form the SGLang plugin passes around."""
    return lse_to_natural(device) != 1.0


# -- the kernels ---------------------------------------------------------------------------------


def _finish(out: torch.Tensor, lse: torch.Tensor, count: torch.Tensor, factor: float) -> PartialOut:
    empty = (count == 0)[:, None]  # [n, 1]
    lse = torch.where(empty, float("-inf"), lse.float() * factor)
    return out.contiguous().masked_fill_(empty[..., None], 0.0), lse


def sparse_partial(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
    prep: Prep = prep_indices, lengths: bool = False,
) -> PartialOut:  # fmt: skip
    """Sparse partial attention over bf16 rows through FlashMLA (``partial_attention``'s
    contract).

    Args:
        q: ``[n, h, 576]`` bf16 on an SM90 GPU, 1 ≤ h ≤ 128.
        kv: ``[N, 576]`` bf16 rows, contiguous.
        indices: int ``[n, k]`` rows; -1 (or outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: must be 512.
        prep: the index preparation (the registry passes :func:`prep_triton`).
        lengths: the kernel told each row's valid count (``raw_sparse``).

    Returns:
        O ``[n, h, 512]`` bf16, LSE ``[n, h]`` float32 natural log; empty rows O = 0, LSE = -inf.
    """
    n, h, d = q.shape
    assert q.dtype == kv.dtype == torch.bfloat16 and d == D_QK and d_v == D_V, (
        f"FlashMLA needs bf16 q/kv of width {D_QK} and d_v {D_V}: {q.dtype=} {kv.dtype=} {d=} "
        f"{d_v=}; use the triton kernel for other shapes"
    )
    assert kv.is_contiguous(), "FlashMLA reads the rows as [N, 1, 576]: pass them contiguous"
    if n == 0:
        return q.new_empty(0, h, D_V), torch.empty(0, h, device=q.device)
    factor = lse_to_natural(str(q.device))
    return _finish(*raw_sparse(q, kv, indices, scale, prep, lengths), factor)


def fp8_sparse_partial(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int,
    prep: Prep = prep_indices, factor: float | None = None,
) -> PartialOut:  # fmt: skip
    """Sparse partial attention over fp8 rows through FlashMLA (``partial_attention``'s
    contract).

    Args:
        q: ``[n, h, 576]`` bf16 on an SM90 GPU, 1 ≤ h ≤ 128.
        kv: uint8 ``[N, 656]`` fp8 rows, N a multiple of 64, contiguous.
        indices: int ``[n, k]`` pool rows; -1 (or outside ``[0, N)``) = unused.
        scale: softmax scale; d_v: must be 512.
        prep: the index preparation (the registry passes :func:`prep_triton`).
        factor: ``lse_to_natural(device, fp8=True)`` when the caller probed it (a CUDA graph
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
    factor = lse_to_natural(str(q.device), fp8=True) if factor is None else factor
    return _finish(*raw_fp8(q, kv, indices, scale, prep), factor)


def by_head_groups(
    run: Callable[[torch.Tensor], PartialOut], q: torch.Tensor, group: int = KERNEL_MAX_HEADS
) -> PartialOut:
    """``run(q)`` for ``q [n, h, d]`` whose heads FlashMLA takes at once (h ≤ ``group``), else
    ``run`` over each group of ``group`` heads, O and LSE joined along the heads: exact, each
    head's softmax is its own (a 160-head model: a group of 128, one of 32 padded to 64)."""
    h = q.shape[1]
    if h <= group:
        return run(q)
    parts = [run(q[:, i : i + group].contiguous()) for i in range(0, h, group)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)


def flashmla_partial_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    """The registry's ``flashmla`` kernel: bf16 rows to :func:`sparse_partial`, fp8 rows (uint8
    ``[N, 656]``) to :func:`fp8_sparse_partial`, each with the one-launch Triton index
    preparation; past 128 heads, per group of 128 (:func:`by_head_groups`)."""
    if kv.dtype == torch.uint8:
        return by_head_groups(
            lambda qg: fp8_sparse_partial(qg, kv, indices, scale, d_v, prep=prep_triton), q
        )
    return by_head_groups(
        lambda qg: sparse_partial(qg, kv, indices, scale, d_v, prep=prep_triton), q
    )


def flashmla_lengths_partial_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    """FlashMLA walking each row's valid indices only (``topk_length``), for requests whose rows
    are mostly -1 (one holder's share of a row's top-k): bf16 rows through :func:`prep_lengths`;
    fp8 rows as :func:`flashmla_partial_attention` (the fp8 decode's ``topk_length`` needs
    FlashMLA's newer scheduling API, not wired here)."""
    if kv.dtype == torch.uint8:
        return flashmla_partial_attention(q, kv, indices, scale, d_v)
    return by_head_groups(
        lambda qg: sparse_partial(qg, kv, indices, scale, d_v, prep=prep_lengths, lengths=True), q
    )


def split_sparse_partial(
    q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, scale: float, d_v: int,
    base2: bool, splits: int = 1,
) -> PartialOut:  # fmt: skip
    """FlashMLA's sparse kernel as the SGLang plugin's device path calls it, on rows it already
    prepared: ``rows [n, k]`` int32 pool rows (-1 unused, k a multiple of 64), ``base2``: the
    kernel's LSE base (:func:`sparse_lse_base2`, probed by the caller before any capture).

    The kernel gives each (query row, 64 heads) one CTA, which walks all ``k`` rows: ``splits``
    > 1 cuts them into that many chunks, each a query row of its own, and merges the chunks'
    partials by LSE (:func:`merge_stacked`; exact: a softmax split by keys). Returns (O
    ``[n, h, d_v]`` float32, LSE ``[n, h]`` natural, -inf empty)."""
    n, h, _ = q.shape
    k = rows.shape[1]
    while splits > 1 and (k % splits or (k // splits) % 64):  # FlashMLA: top-k % 64 == 0
        splits //= 2
    q_in = pad_heads(q)
    q_in = q_in.repeat_interleave(splits, dim=0) if splits > 1 else q_in
    idx = rows.reshape(n * splits, k // splits)
    o, _, raw = _sparse_fwd()(q=q_in, kv=kv[:, None], indices=idx[:, None], sm_scale=scale,
                              d_v=d_v)  # fmt: skip
    empty = (idx < 0).all(dim=1)[:, None].expand(n * splits, h)
    lse = to_natural(raw[:, :h], base2).masked_fill(empty, -math.inf)
    o = o[:, :h].float().masked_fill(empty[..., None], 0.0)
    if splits == 1:
        return o, lse
    return merge_stacked(o.reshape(n, splits, h, -1), lse.reshape(n, splits, h), dim=1)
