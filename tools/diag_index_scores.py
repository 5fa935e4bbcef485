"""Where the index-score kernel's time goes: variants of its keys-major tile at one shape.

A diagnostic, not a product path. The tile is ``indexer/triton_scores.py``'s (keys × (row, head)
MMA, ReLU, head weights, head sum), stripped of masks and runtime widths, in three modes:
``full`` (the scores stored), ``mma`` (only the MMAs, summed once at the end) and ``nostore``
(the epilogue without the store); keys by pointer loads or a TMA descriptor; with and without
Triton's warp specialisation. bf16 and fp8 operands. It showed that the product kernel, with
its runtime key width and strides, ran at 0.65x (bf16) and 0.3x (fp8) of ``full``
(``bench/results/index-scores-variants-h200.json``).

    python -m tools.diag_index_scores bench/results/index-scores-variants-<gpu>.json
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tools.gpu_timing import device_ms

MODES = ("full", "mma", "nostore")
#: (m, block_t, warps, stages): (row, head) pairs per program, keys per tile, launch
CONFIGS = ((128, 128, 4, 3), (256, 64, 4, 4), (256, 128, 8, 3))


@triton.jit
def _kernel(
    q_ptr, w_ptr, k_ptr, kdesc, out_ptr, t, s_on, blocks_per_split,
    R: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, MODE: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = tl.arange(0, R * HP)
    row = pid_r * R + m // HP
    head = m % HP
    dd = tl.arange(0, 128)
    q = tl.load(q_ptr + row[None, :] * (HP * 128) + head[None, :] * 128 + dd[:, None])
    w = tl.load(w_ptr + row * HP + head)
    rows = pid_r * R + tl.arange(0, R)
    first = pid_s * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(t, BLOCK_T))
    tot = tl.zeros((BLOCK_T, R * HP), dtype=tl.float32)
    for blk in tl.range(first, last, num_stages=STAGES, warp_specialize=WS):
        keys = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        if TMA:
            kv = kdesc.load([blk * BLOCK_T, 0])
        else:
            kv = tl.load(k_ptr + keys[:, None] * 128 + dd[None, :])
        if MODE == 1:
            tot = tl.dot(kv, q, tot)
        else:
            acc = tl.maximum(tl.dot(kv, q), 0.0) * w[None, :]
            s = tl.sum(tl.reshape(acc, (BLOCK_T, R, HP)), axis=2)
            if MODE == 0:
                tl.store(out_ptr + rows[None, :] * s_on + keys[:, None], s)
            else:
                tot += tl.sum(s, axis=1)[:, None]
    if MODE != 0:
        tl.store(out_ptr + pid_r * s_on + pid_s, tl.sum(tl.sum(tot, axis=1), axis=0))


def launch(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, out: torch.Tensor,
    m: int, bt: int, mode: int, tma: bool, ws: bool, warps: int, stages: int,
) -> None:  # fmt: skip
    """One call: ``q [n, HP, 128]``, ``keys [t, 128]`` (t a multiple of ``bt``)."""
    n, hp, _ = q.shape
    t = keys.shape[0]
    r = m // hp
    blocks, row_programs = t // bt, n // r
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = min(blocks, max(1, -(-4 * sms // row_programs)))
    per = -(-blocks // splits)
    desc = TensorDescriptor.from_tensor(keys, [bt, 128]) if tma else keys
    _kernel[(row_programs, -(-blocks // per))](
        q, w, keys, desc, out, t, out.stride(0), per,
        R=r, HP=hp, BLOCK_T=bt, MODE=mode, TMA=tma, WS=ws, STAGES=stages, num_warps=warps,
    )  # fmt: skip


def main() -> None:
    n, heads, t = 1024, 64, 65536
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        q = (torch.randn(n, heads, 128, generator=g, device="cuda") / 4).to(dtype)
        keys = (torch.randn(t, 128, generator=g, device="cuda") / 4).to(dtype)
        w = torch.randn(n, heads, device="cuda")
        out = torch.empty(n, t, device="cuda")
        for mode, tma, ws, (m, bt, warps, stages) in itertools.product(
            range(len(MODES)), (False, True), (False, True), CONFIGS
        ):
            row = {"dtype": str(dtype).removeprefix("torch."), "mode": MODES[mode], "tma": tma}
            row.update(ws=ws, m=m, bt=bt, warps=warps, stages=stages)
            try:
                fn = functools.partial(launch, q, w, keys, out, m, bt, mode, tma, ws, warps, stages)
                ms = statistics.median(device_ms(fn, 7, warmup=1))
                row.update(ms=round(ms, 3), tflops=round(2 * n * heads * 128 * t / ms / 1e9, 1))
            except Exception as e:  # a variant the compiler refuses: say which
                row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:160]
            print(json.dumps(row), flush=True)
            rows.append(row)
    out_path = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/index-scores-variants.json")
    out_path.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
