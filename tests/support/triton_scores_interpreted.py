"""Run the Triton index-score kernel in Triton's CPU interpreter against ``index_scores``.

Started by ``tests/unit/test_triton_scores.py`` with ``TRITON_INTERPRET=1`` in a fresh process
(Triton decides at import whether it interprets). Prints "N cases ok"; a mismatch raises with
the case in the message.
"""

from __future__ import annotations

import itertools
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import tests.support.triton_patch  # noqa: E402,F401  (before any kernel module)
from indexer.scores import index_scores  # noqa: E402
from indexer.triton_scores import triton_index_scores  # noqa: E402

# (n, heads, d, keys, dtype, arith): head counts off powers of two, widths off the 128 block,
# rows off the R-row tile and keys off BLOCK_T; fp32 models take the IEEE dot.
CASES = [
    (3, 16, 64, 70, torch.bfloat16, "exact"),
    (5, 5, 48, 33, torch.bfloat16, "exact"),
    (2, 64, 128, 150, torch.bfloat16, "exact"),
    (3, 16, 64, 40, torch.float32, "exact"),
    (2, 8, 128, 90, torch.bfloat16, "fp8"),
    (3, 4, 256, 20, torch.bfloat16, "fp8"),  # two quant blocks per key
    (2, 4, 200, 300, torch.bfloat16, "exact"),  # two 128-wide blocks, the second partial
    (2, 2, 300, 10, torch.float32, "exact"),  # wider than two blocks: the torch reference
    (2, 300, 16, 20, torch.float32, "exact"),  # more heads than the kernel's tile: torch
]


def main() -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    for n, heads, d, t, dtype, arith in CASES:
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        keys = torch.randn(t, d, generator=g).to(dtype)
        w = torch.randn(n, heads, generator=g) * heads**-0.5
        limits = (None, torch.randint(0, t + 2, (n,), generator=g))  # causal masks, some empty
        for m, limit in itertools.product((64, 256), limits):
            ref = index_scores(q, w, keys, d**-0.5, arith, limit)
            cfg = {"m": m}  # rows per program: 1 to 64 here
            got = triton_index_scores(q, w, keys, d**-0.5, arith, 32, cfg, limit)
            case = f"{n=} {heads=} {d=} {t=} {dtype} {arith} {m=} {limit=}"
            masked = torch.isinf(ref)
            assert got.shape == ref.shape and torch.equal(torch.isinf(got), masked), case
            assert bool((got[masked] < 0).all()), f"{case}: masked keys are -inf"
            diff = (got - ref).masked_fill(masked, 0.0).abs().max()
            err = float(diff / ref.masked_fill(masked, 0.0).abs().max().clamp(min=1e-6))
            assert err < 2e-5, f"{case}: {err=}"
    empty = triton_index_scores(torch.zeros(0, 4, 64), torch.zeros(0, 4), torch.zeros(9, 64), 0.125)
    assert empty.shape == (0, 9)
    print(f"{len(CASES) + 1} cases ok")


if __name__ == "__main__":
    main()
