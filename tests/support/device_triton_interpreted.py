"""Run the device path's Triton kernels (``requester/sglang/device_triton.py``) in Triton's CPU
interpreter against the torch code they replace.

Started by ``tests/unit/test_device_triton.py`` with ``TRITON_INTERPRET=1`` in a fresh process.
Prints "N cases ok"; a mismatch raises with the case in the message.
"""

from __future__ import annotations

import math
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import tests.support.triton_patch  # noqa: E402,F401  (before any kernel module)
from corpusd.kernels.merge import merge_partials  # noqa: E402
from requester.sglang import device, device_triton, lse  # noqa: E402


def topk_cases(g: torch.Generator) -> int:
    """fused_topk: ties inside and across the corpus/own boundary, -0.0 against +0.0, NaN and
    -inf, rows shorter than k, unbound rows (corpus length 0), garbage past the lengths."""
    cases = 0
    for n, wc, wo, k in ((3, 100, 20, 64), (4, 37, 5, 16), (2, 10, 3, 32), (5, 300, 40, 128)):
        cs = torch.randn(n, wc, generator=g)
        os_ = torch.randn(n, wo, generator=g)
        cs[0, ::3] = 0.5
        os_[0, ::2] = 0.5  # ties across the boundary
        cs[1 % n, ::4] = -0.0
        cs[1 % n, 1::4] = 0.0
        cs[2 % n, 5] = float("nan")
        cs[2 % n, 6] = float("-inf")
        clen = torch.randint(0, wc + 1, (n,), generator=g)
        clen[0] = wc
        clen[-1] = 0  # an unbound row
        olen = torch.randint(0, wo + 1, (n,), generator=g)
        got = device.fused_topk(cs, clen, os_, olen, k)  # the kernels, under the interpreter
        want = device.fused_topk_torch(cs, clen, os_, olen, k)
        for a, b, side in zip(got, want, ("corpus", "own"), strict=True):
            case = f"topk {side} {n=} {wc=} {wo=} {k=}"
            assert a.dtype == b.dtype and a.shape == b.shape, case
            assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values), case
        cases += 1
    return cases


def rows_cases(g: torch.Generator) -> int:
    cases = 0
    for n, k, pages, p in ((3, 40, 9, 8), (2, 7, 3, 4)):
        positions = torch.randint(-1, pages * p // 2, (n, k), generator=g)
        base = torch.randint(0, pages // 2, (n,), generator=g)
        holder = torch.randint(-1, 2, (pages,), generator=g).to(torch.int32)
        frame = torch.randint(0, 50, (pages,), generator=g).to(torch.int32)
        got = device.corpus_rows(positions, base, holder, frame, p)
        want = device.corpus_rows_torch(positions, base, holder, frame, p)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rows {n=} {k=}"
        cases += 1
    return cases


def stage_cases(g: torch.Generator) -> int:
    """stage_rows: plain bf16 rows (int64 words), FlashMLA's fp8 656-byte rows, 12-byte rows
    (int32 words) and 3-byte rows (bytes); 1 to 3 pools, unused entries, a holder with no
    entry; the copy is bit for bit and ``idx`` the same, where the kernels wrote."""
    cases = 0
    shapes = (((576,), torch.bfloat16), ((656,), torch.uint8), ((3,), torch.float32),
              ((3,), torch.uint8))  # fmt: skip
    for (row, dtype), (n, k, pools) in zip(shapes, ((3, 64, 3), (2, 40, 2), (4, 7, 1), (1, 5, 2)),
                                           strict=True):  # fmt: skip
        size = 50
        made = [torch.randn(size, *row, generator=g) * 100 for _ in range(pools)]
        pool_list = [t.to(dtype) for t in made]
        holder = torch.randint(-1, pools, (n, k), generator=g).to(torch.int32)
        rows = torch.randint(-1, size, (n, k), generator=g).to(torch.int32)
        rows = torch.where(holder >= 0, rows, -1)
        if pools > 1:
            holder[holder == pools - 1] = 0  # the last pool: no entry at all
        # the last pool also copied through a column map (its row reversed), the others not
        d = pool_list[0].shape[1]
        maps: list[list[torch.Tensor | None]] = [
            [None] * pools, [None] * (pools - 1) + [torch.arange(d - 1, -1, -1)]
        ]  # fmt: skip
        for cols in maps:
            kv, idx = device_triton.stage_rows(pool_list, holder, rows, cols)
            kv_ref, idx_ref = device.stage_rows_torch(pool_list, holder, rows, cols)
            case = f"stage {row} {dtype} {n=} {k=} {pools=} mapped={cols[-1] is not None}"
            assert kv.shape == kv_ref.shape and kv.shape[0] % 64 == 0, case
            assert idx.dtype == torch.int32 and torch.equal(idx, idx_ref), case
            used = idx[idx >= 0].long()
            a, b = kv[used].view(torch.uint8), kv_ref[used].view(torch.uint8)
            assert torch.equal(a, b), case
            cases += 1
    return cases


def merge_cases(g: torch.Generator) -> int:
    cases = 0
    for n, h, dv, dtype in ((3, 4, 64, torch.bfloat16), (2, 3, 40, torch.float32)):
        oa = torch.randn(n, h, dv, generator=g).to(dtype)
        ob = torch.randn(n, h, dv, generator=g)
        la = torch.randn(n, h, generator=g) * 3
        lb = torch.randn(n, h, generator=g) * 3
        la[0, 0] = -math.inf  # local empty
        lb[0, 1] = -math.inf  # corpus empty
        la[1, 0] = lb[1, 0] = -math.inf  # both: O = 0, LSE = -inf
        o, t = lse.merge_local_corpus(oa, la, ob, lb)
        o_ref, t_ref = merge_partials([(oa, la), (ob, lb)])  # the one torch merge
        case = f"merge {n=} {h=} {dv=} {dtype}"
        assert o.dtype == o_ref.dtype and torch.equal(torch.isinf(t), torch.isinf(t_ref)), case
        fin = torch.isfinite(t_ref)
        assert torch.allclose(t[fin], t_ref[fin], rtol=1e-6, atol=1e-6), case
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # one bf16 rounding of O
        assert torch.allclose(o.float(), o_ref.float(), rtol=tol, atol=tol), case
        assert bool((o[1, 0] == 0).all()), f"{case}: both empty"
        cases += 1
    return cases


def main() -> None:
    assert device_triton.usable(torch.zeros(1)), "the interpreter runs the kernels on CPU"
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    print(f"{topk_cases(g) + rows_cases(g) + stage_cases(g) + merge_cases(g)} cases ok")


if __name__ == "__main__":
    main()
