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
- ``fp8``: the MMA takes the e4m3 values themselves (fp8 tensor cores, twice bf16's rate),
  as SGLang's fp8 logits kernel does; each 128-wide block's dot is then scaled by the query's
  power-of-two (ue8m0) scale and the key's float32 one. With one block per key (V3.2's 128-wide
  index keys) both scales leave the tile: ``relu(a·b·x) = a·b·relu(x)`` for positive scales,
  so the query's multiplies its head weight and the key's the head-summed score. The products
  of two e4m3 values are exact; the tensor cores' accumulation over a block's 128 products
  keeps fewer bits than float32 (DeepSeek-V3's report: about 14), as in SGLang's kernel.

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
# there tiles are upcast to float32 first (corpusd/kernels/triton_mla.py does the same).
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
    # n, t and the split change every prefill chunk: not specialised (one compile). The key
    # and output strides are (divisibility by 16 lets the loads and stores vectorise) and the
    # key width D is a constant: with a runtime D the width mask blocked vectorised key loads,
    # and the kernel ran at 0.65x (bf16) and 0.3x (fp8) of bench/exp/scores_variants.py's
    # unmasked tile (bench/results/index-scores-variants-h200.json).
    @triton.jit(do_not_specialize=["n", "t", "blocks_per_split"])
    def _scores_kernel(
        q_ptr, w_ptr, k_ptr, ks_ptr, qs_ptr, lim_ptr, out_ptr,
        n, t, heads, scale, blocks_per_split,
        s_qn, s_qh, s_wn, s_kt, s_ks, s_qsn, s_qsh, s_on,
        D: tl.constexpr, R: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr,
        D_BLOCKS: tl.constexpr,
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
        q0 = tl.load(q_at, mask=qmask[None, :] & (dd < D)[:, None], other=0.0)
        q1 = q0  # the second 128-wide block of a 256-wide key (D_BLOCKS == 2)
        if D_BLOCKS == 2:
            second = qmask[None, :] & (BLOCK_D + dd < D)[:, None]
            q1 = tl.load(q_at + BLOCK_D, mask=second, other=0.0)
        if DOT_F32:
            q0 = q0.to(tl.float32)
            q1 = q1.to(tl.float32)
        # relu(s·x)·w = relu(x)·(s·w) for s > 0: one multiply less per score
        w = tl.load(w_ptr + row * s_wn + head, mask=qmask, other=0.0) * scale
        qs_at = qs_ptr + row * s_qsn + head * s_qsh  # per-block query scales (two-block fp8)
        rows = pid_r * R + tl.arange(0, R)
        lim = rows  # unused unless HAS_LIMIT
        if HAS_LIMIT:
            lim = tl.load(lim_ptr + rows, mask=rows < n, other=0)
        first = pid_s * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.cdiv(t, BLOCK_T))
        live = last  # key blocks that some row of this program may see
        if HAS_LIMIT:  # blocks wholly past every row's limit are -inf: no MMA for them
            live = tl.maximum(first, tl.minimum(last, tl.cdiv(tl.max(lim), BLOCK_T)))
        for blk in range(first, live):
            keys = blk * BLOCK_T + tl.arange(0, BLOCK_T)
            kmask = keys < t
            acc = tl.zeros((BLOCK_T, R * HP), dtype=tl.float32)
            for j in tl.static_range(D_BLOCKS):
                dmask = j * BLOCK_D + dd < D
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
                if HAS_KS and D_BLOCKS == 2:  # this block's key and query scales
                    ks = tl.load(ks_ptr + keys * s_ks + j, mask=kmask, other=0.0)
                    qs = tl.load(qs_at + j, mask=qmask, other=0.0)
                    part = part * ks[:, None] * qs[None, :]
                acc += part
            acc = tl.maximum(acc, 0.0) * w[None, :]
            s = tl.sum(tl.reshape(acc, (BLOCK_T, R, HP)), axis=2)
            if HAS_KS and D_BLOCKS == 1:  # one block: the key's scale after the head sum
                s = s * tl.load(ks_ptr + keys * s_ks, mask=kmask, other=0.0)[:, None]
            if HAS_LIMIT:
                s = tl.where(keys[:, None] >= lim[None, :], float("-inf"), s)
            omask = kmask[:, None] & (rows[None, :] < n)
            tl.store(out_ptr + rows[None, :] * s_on + keys[:, None], s, mask=omask)
        for blk in range(live, last):  # (HAS_LIMIT only) the causal triangle's far side
            keys = blk * BLOCK_T + tl.arange(0, BLOCK_T)
            omask = (keys < t)[:, None] & (rows[None, :] < n)
            none = tl.full((BLOCK_T, R), float("-inf"), tl.float32)
            tl.store(out_ptr + rows[None, :] * s_on + keys[:, None], none, mask=omask)


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
    block_t: int = 0,
    config: dict | None = None,
    limit: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`indexer.scores.index_scores` (same arguments, float32 ``[n, T]``; keys at or
    past ``limit`` score ``-inf``, in the kernel).
    ``config`` overrides the launch (``tools/bench_index_scores.py --sweep``): ``m`` ((row,
    head) pairs per program), ``warps``, ``stages``; ``block_t`` keys per tile (0: the
    arithmetic's default)."""
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
    ks = qs = None
    w = weights.float()
    if arith == "fp8":
        q, qs = quantize(rotate_round(q), ue8m0=True)  # e4m3 [n, H, d], scales [n, H, d/128]
        keys, ks = quantize(rotate_round(keys), ue8m0=False)
        ks = ks.contiguous()
        if d == _QUANT_BLOCK:  # one block: the query's scale multiplies its head weight
            w, qs = w * qs[..., 0], None
        else:
            qs = qs.contiguous()
    elif q.dtype != keys.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        q, keys = q.float(), keys.float()
    ieee = q.dtype == torch.float32
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    w = w.contiguous()
    out = torch.empty(n, t, dtype=torch.float32, device=q.device)
    if n == 0 or t == 0:
        return out
    # tools/bench_index_scores.py --sweep on an H200 (bench/results/index-scores-h200.json):
    # fp8 tiles are half the bytes, so shorter key blocks with a deeper pipeline win there
    c = {"m": 128, "warps": 4, "stages": 4 if ks is not None else 3, **(config or {})}
    block_t = block_t or (64 if ks is not None else 128)
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
        q, w, keys, w if ks is None else ks, w if qs is None else qs, w if lim is None else lim,
        out, n, t, heads, float(scale), per_split,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), 0 if ks is None else ks.stride(0),
        0 if qs is None else qs.stride(0), 0 if qs is None else qs.stride(1), out.stride(0),
        D=d, R=r, HP=hp, BLOCK_D=block_d, D_BLOCKS=triton.cdiv(d, block_d), BLOCK_T=block_t,
        HAS_KS=ks is not None, HAS_LIMIT=lim is not None, IEEE=ieee, DOT_F32=_DOT_F32,
        num_warps=c["warps"] if r * hp >= 128 else 4, num_stages=c["stages"],
    )  # fmt: skip
    return out
