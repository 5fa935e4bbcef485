"""Lightning-indexer scores in one Triton kernel: :func:`indexer.scores.index_scores` on a GPU.

The torch path writes the ``[n · H_I, keys]`` per-head products to memory, reads them back for
the ReLU and again for the weighted head sum: at a 256k-token pin that is ~30 TB of traffic per
layer. Here one program takes ``R`` query rows and loops over a run of ``BLOCK_T``-key blocks:
the per-head dot products ``[BLOCK_T, R · H_I]`` on tensor cores (bf16 operands, fp32
accumulation), the ReLU, head weights (the scale folded in) and head sum in registers, keys past
a row's causal ``limit`` set to -inf, and only the ``[R, BLOCK_T]`` scores written.

Arithmetic, against the float32 reference:

- ``exact``: the model's bf16 queries and keys are the operands (exact in bf16, so every
  product is exact in fp32); the ``D ** -0.5`` scale multiplies the head weights instead of
  the queries (``relu(s·x)·w = relu(x)·(s·w)`` for ``s > 0``). Only roundings differ.
- ``fp8``: operands are the fp8 values (exact in bf16): queries dequantised with their
  power-of-two (ue8m0) scales, keys as raw e4m3 values with their float32 per-block scale
  applied to each 128-wide block's partial dot, as SGLang's fp8 logits kernel does.

Float32 inputs (an fp32 model) use Triton's IEEE fp32 dot instead of bf16 operands.
"""

from __future__ import annotations

import os

import torch

from indexer.fp8 import quantize, rotate_round
from indexer.scores import index_scores

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: importable() says so
    triton = None

# Triton's CPU interpreter (the CPU tests) multiplies the raw bits of bf16 operands in tl.dot;
# there tiles are upcast to float32 first (holder/triton_mla.py does the same).
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"
_QUANT_BLOCK = 128  # indexer.fp8's block: one key scale per 128 columns
_MAX_HEADS = 256  # one row's heads fill at most a 256-wide MMA N (more: the torch path)


def importable() -> bool:
    return triton is not None


def usable(device: torch.device) -> bool:
    """A CUDA device with Triton present (or Triton's CPU interpreter, for tests)."""
    if triton is None:
        return False
    return _DOT_F32 or (device.type == "cuda" and torch.cuda.is_available())


if triton is not None:

    @triton.jit(do_not_specialize=["n", "t", "blocks_per_split", "s_kt", "s_on"])
    def _scores_kernel(
        q_ptr, w_ptr, k_ptr, ks_ptr, lim_ptr, out_ptr,
        n, t, heads, d, scale, blocks_per_split,
        s_qn, s_qh, s_wn, s_kt, s_ks, s_on,
        R: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr, D_BLOCKS: tl.constexpr,
        BLOCK_T: tl.constexpr, HAS_KS: tl.constexpr, HAS_LIMIT: tl.constexpr,
        IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # One program: R query rows against a contiguous run of key blocks, looped so that the
        # queries [D, R·HP] stay in registers and the key loads pipeline. Keys-major: the MMA
        # computes [BLOCK_T keys, R·HP (row, head) pairs], so the head sum runs along the
        # accumulator's N dimension (within a thread and its quad, no shared-memory round
        # trip). The rows-major [R·HP, BLOCK_T] tile was 1.4x slower and two [BLOCK_T, HP]
        # MMAs per program no faster (bench/results/index-scores-h200{-layouts,}.json).
        pid_r = tl.program_id(0)
        pid_s = tl.program_id(1)
        m = tl.arange(0, R * HP)
        row = pid_r * R + m // HP
        head = m % HP
        qmask = (row < n) & (head < heads)
        dd = tl.arange(0, BLOCK_D)
        q_at = q_ptr + row[None, :] * s_qn + head[None, :] * s_qh + dd[:, None]
        q0 = tl.load(q_at, mask=qmask[None, :] & (dd < d)[:, None], other=0.0)
        q1 = q0  # the second 128-wide block of a 256-wide key (D_BLOCKS == 2)
        if D_BLOCKS == 2:
            second = qmask[None, :] & (BLOCK_D + dd < d)[:, None]
            q1 = tl.load(q_at + BLOCK_D, mask=second, other=0.0)
        if DOT_F32:
            q0 = q0.to(tl.float32)
            q1 = q1.to(tl.float32)
        # relu(s·x)·w = relu(x)·(s·w) for s > 0: one multiply less per score
        w = tl.load(w_ptr + row * s_wn + head, mask=qmask, other=0.0) * scale
        rows = pid_r * R + tl.arange(0, R)
        lim = rows  # unused unless HAS_LIMIT
        if HAS_LIMIT:
            lim = tl.load(lim_ptr + rows, mask=rows < n, other=0)
        first = pid_s * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(t, BLOCK_T))
        for blk in range(first, last):
            keys = blk * BLOCK_T + tl.arange(0, BLOCK_T)
            kmask = keys < t
            acc = tl.zeros((BLOCK_T, R * HP), dtype=tl.float32)
            for j in tl.static_range(D_BLOCKS):
                dmask = j * BLOCK_D + dd < d
                kv = tl.load(
                    k_ptr + keys[:, None] * s_kt + (j * BLOCK_D + dd)[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0,
                )  # fmt: skip
                if DOT_F32:
                    kv = kv.to(tl.float32)
                qv = q0 if j == 0 else q1
                if IEEE:  # noqa: SIM108  (a constexpr branch: one dot is compiled)
                    part = tl.dot(kv, qv, input_precision="ieee")
                else:
                    part = tl.dot(kv, qv)
                if HAS_KS:  # the key's scale of this 128-wide block
                    ks = tl.load(ks_ptr + keys * s_ks + j, mask=kmask, other=0.0)
                    part = part * ks[:, None]
                acc += part
            acc = tl.maximum(acc, 0.0) * w[None, :]
            s = tl.sum(tl.reshape(acc, (BLOCK_T, R, HP)), axis=2)
            if HAS_LIMIT:
                s = tl.where(keys[:, None] >= lim[None, :], float("-inf"), s)
            omask = kmask[:, None] & (rows[None, :] < n)
            tl.store(out_ptr + rows[None, :] * s_on + keys[:, None], s, mask=omask)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the split arithmetic is exercised
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def triton_index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    arith: str = "exact",
    block_t: int = 128,
    config: dict | None = None,
    limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`indexer.scores.index_scores` (same arguments, float32 ``[n, T]``; keys at or
    past ``limit`` score ``-inf``, in the kernel).
    ``config`` overrides the launch (``tools/bench_index_scores.py --sweep``): ``m`` ((row,
    head) pairs per program), ``warps``, ``stages``."""
    n, heads, d = q.shape
    assert triton is not None, "triton is not installed"
    assert scale > 0, f"{scale=}"
    assert weights.shape == (n, heads), f"{weights.shape=} vs {q.shape=}"
    assert keys.dim() == 2 and keys.shape[1] == d, f"{keys.shape=} vs {q.shape=}"
    assert arith in ("exact", "fp8"), f"{arith=}"
    t = keys.shape[0]
    if d > 2 * _QUANT_BLOCK or heads > _MAX_HEADS:
        # the kernel holds at most two 128-wide blocks of each query and a [128, 256] tile
        return index_scores(q, weights, keys, scale, arith, limit)
    ks = None
    if arith == "fp8":
        qv, qs = quantize(rotate_round(q), ue8m0=True)
        # power-of-two scales: the dequantised queries are exact in bf16
        q = (qv.float().unflatten(-1, (-1, _QUANT_BLOCK)) * qs.unsqueeze(-1)).flatten(-2)
        q = q.to(torch.bfloat16)
        kv8, ks = quantize(rotate_round(keys), ue8m0=False)
        keys = kv8.to(torch.bfloat16)  # e4m3 values are exact in bf16
        ks = ks.contiguous()
    elif q.dtype != keys.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        q, keys = q.float(), keys.float()
    ieee = q.dtype == torch.float32
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    w = weights.float().contiguous()
    out = torch.empty(n, t, dtype=torch.float32, device=q.device)
    if n == 0 or t == 0:
        return out
    # tools/bench_index_scores.py --sweep on an H200 (bench/results/index-scores-h200.json)
    c = {"m": 128, "warps": 4, "stages": 3, **(config or {})}
    hp = _pow2(heads)
    block_d = _QUANT_BLOCK if ks is not None or d > _QUANT_BLOCK else max(16, _pow2(d))
    r = max(1, c["m"] // hp)  # R rows per program: R·HP (row, head) pairs, the MMA's N
    row_programs = triton.cdiv(n, r)
    blocks = triton.cdiv(t, block_t)
    # enough programs to fill the GPU ~4 times over, each with a long run of key blocks
    splits = min(blocks, max(1, -(-4 * _sms(q.device) // row_programs)))
    per_split = triton.cdiv(blocks, splits)
    lim = None if limit is None else limit.to(torch.int64).contiguous()
    _scores_kernel[(row_programs, triton.cdiv(blocks, per_split))](
        q, w, keys, ks if ks is not None else w, lim if lim is not None else w, out,
        n, t, heads, d, float(scale), per_split,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0),
        ks.stride(0) if ks is not None else 0, out.stride(0),
        R=r, HP=hp, BLOCK_D=block_d, D_BLOCKS=triton.cdiv(d, block_d), BLOCK_T=block_t,
        HAS_KS=ks is not None, HAS_LIMIT=lim is not None, IEEE=ieee, DOT_F32=_DOT_F32,
        num_warps=c["warps"] if r * hp >= 128 else 4, num_stages=c["stages"],
    )  # fmt: skip
    return out
