"""Run the Triton kernel in Triton's CPU interpreter against the torch reference.

Started by ``tests/test_gpu_kernels.py`` with ``TRITON_INTERPRET=1`` in a fresh process (Triton
decides at import whether its library functions are interpreted). Prints "N cases ok"; any
mismatch raises with the case in the message.
"""

from __future__ import annotations

import os

import torch

import tests.support.triton_patch  # noqa: F401  (before any kernel module)
from corpusd.kernels.reference import partial_attention
from corpusd.kernels.triton_mla import triton_partial_attention
from tests.support.mla_checks import check, inputs, rel

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

CASES = [
    (4, 5, 40, torch.float32, None),  # h not a power of two, k not a block multiple
    (3, 16, 64, torch.bfloat16, 2),  # split k, merged by LSE
    (5, 3, 100, torch.bfloat16, 3),  # uneven splits, one of them all padding in row 0
    (3, 17, 33, torch.bfloat16, 1),  # two head blocks
]


def main() -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    d_v, d = 32, 48  # the kernel is width-generic; small widths keep the interpreter fast
    for n, h, k, dtype, splits in CASES:
        q, kv, idx = inputs(g, n, h, 70, k, d, dtype, "cpu")
        out = triton_partial_attention(q, kv, idx, d**-0.5, d_v, splits=splits, block_n=32)
        check(out, q, kv, idx, d**-0.5, d_v, f"{n=} {h=} {k=} {dtype=} {splits=}")
    # indices past the pool are unused slots, never read
    q, kv, idx = inputs(g, 2, 4, 50, 16, 48, torch.float32, "cpu")
    wild, ref = idx.clone(), idx.clone()
    wild[:, ::2] = 50 + torch.arange(8)
    ref[:, ::2] = -1
    o, lse = triton_partial_attention(q, kv, wild, 0.1, 32)
    ro, rl = partial_attention(q, kv, ref, 0.1, 32)
    assert rel(o, ro) < 1e-5 and float((lse - rl).abs().max()) < 1e-5, "past-the-pool indices"
    # compacted lists (one holder's share of each row's top-k at a fixed width: valid first,
    # -1 after), whose all -1 blocks and splits the kernel skips: 5 valid, none, all 96
    q, kv, idx = inputs(g, 3, 4, 70, 96, 48, torch.bfloat16, "cpu")
    idx[0, 5:] = -1
    idx[1] = -1
    for splits, skip in ((1, True), (3, True), (3, False)):
        out = triton_partial_attention(q, kv, idx, d**-0.5, d_v, splits=splits, block_n=32,
                                       skip_empty=skip)  # fmt: skip
        check(out, q, kv, idx, d**-0.5, d_v, f"compacted, {splits=} {skip=}")
    # float32 O from bf16 inputs: the accumulator unrounded, within one bf16 step of the bf16 O
    # (the interpreter's conversion need not round to nearest, so not its rounding exactly)
    q, kv, idx = inputs(g, 3, 16, 70, 64, 48, torch.bfloat16, "cpu")
    for splits in (1, 2):
        o16, l16 = triton_partial_attention(q, kv, idx, 0.1, 32, splits=splits, block_n=32)
        o32, l32 = triton_partial_attention(q, kv, idx, 0.1, 32, splits=splits, block_n=32,
                                            out_dtype=torch.float32)  # fmt: skip
        assert o32.dtype == torch.float32 and torch.equal(l32, l16), f"{splits=}"
        step = (o32 - o16.float()).abs() <= 2**-7 * o32.abs()
        assert bool(step.all()), f"{splits=}: O is the bf16 O before rounding"
        ro, _ = partial_attention(q.double(), kv.double(), idx, 0.1, 32)
        assert rel(o32.double(), ro) < rel(o16.double(), ro), f"{splits=}: closer unrounded"
    print(f"{len(CASES) + 4} cases ok")


if __name__ == "__main__":
    main()
