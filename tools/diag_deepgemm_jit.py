"""The defect SCORE_ROWS fixes (issue 17), shown: DeepGEMM's paged index scoring called unchunked
at row counts this process has not used before, each paying a JIT compile of its schedule kernel
(a template on the row count rounded up to 32). GPU with sglang's deep_gemm::

    python -m tools.diag_deepgemm_jit
"""

from __future__ import annotations

import time

import torch

from corpusd.testing.resident import random_resident
from requester.sglang import device_scores


def main() -> None:
    res, (a, _) = random_resident([3000, 700])
    dg = device_scores._deep_gemm()
    for n in (601, 1303, 77):
        q = torch.randn(n, 64, 128, device="cuda").to(torch.float8_e4m3fn)
        w = torch.rand(n, 64, device="cuda")
        base = torch.full((n,), a.base_page, dtype=torch.int32, device="cuda")
        lens = torch.full((n,), a.tokens, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        device_scores._paged_logits(dg, res, 0, q, w, res.block_table(base), lens)
        torch.cuda.synchronize()
        print(f"unchunked {n} rows: {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
