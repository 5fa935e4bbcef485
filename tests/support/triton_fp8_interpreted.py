"""Run the fp8 Triton kernel in Triton's CPU interpreter against the fp8 torch reference.

Started by ``tests/gpu/test_gpu_fp8.py`` with ``TRITON_INTERPRET=1`` in a fresh process
(Triton decides at import whether its library functions are interpreted). Prints "N cases ok";
any mismatch raises with the case in the message. The interpreter multiplies in float32
(``triton_common.DOT_F32``), so the kernel must match the reference to float32 rounding: the
dequantization (bf16 scale, bf16 product) has to be FlashMLA's, bit for bit, to pass.
"""

from __future__ import annotations

import os

import torch

import tests.support.triton_patch  # noqa: F401  (before any kernel module)
from corpusd.kernels import fp8_cache as f8
from corpusd.kernels.triton_fp8 import triton_fp8_partial_attention
from tests.support.mla_checks import rel

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

CASES = [  # n, h, k, q dtype, splits
    (4, 5, 40, torch.float32, None),  # h not a power of two, k not a block multiple
    (3, 16, 64, torch.bfloat16, 2),  # split k, merged by LSE
    (3, 17, 33, torch.float32, 1),  # two head blocks
]


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ΔLSE| / (1 + |LSE|): float32 sums of large logits differ in the last bits."""
    return float(((lse - ref).abs() / (1 + ref.abs())).max())


def main() -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    pool = 90
    # magnitudes spread over tiles, so a wrong tile → scale mapping shows
    lat = torch.randn(pool, 576, generator=g) * torch.exp2(torch.randint(-2, 2, (pool, 1)))
    lat[:, :512] *= torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat_interleave(128)
    packed = f8.quantize(lat.bfloat16())
    for n, h, k, dtype, splits in CASES:
        what = f"{n=} {h=} {k=} {dtype=} {splits=}"
        q = torch.randn(n, h, 576, generator=g).to(dtype)
        idx = torch.randint(0, pool, (n, k), generator=g)
        idx[0] = -1  # an empty row
        idx[-1, k // 2 :] = -1
        o, lse = triton_fp8_partial_attention(q, packed, idx, 576**-0.5, 512, splits=splits)
        ro, rl = f8.fp8_partial_attention(q, packed, idx, 576**-0.5, 512)
        assert o.dtype == dtype and lse.dtype == torch.float32, what
        assert float(o[0].abs().max()) == 0.0 and bool(torch.isneginf(lse[0]).all()), what
        err, lse_err = rel(o[1:].float(), ro[1:].float()), _lse_err(lse[1:], rl[1:])
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 output rounding
        assert err < tol and lse_err < 1e-5, f"{what}: O rel {err:.2e}, LSE rel {lse_err:.2e}"
    # indices past the pool are unused slots, never read
    q = torch.randn(2, 4, 576, generator=g)
    idx = torch.randint(0, pool, (2, 16), generator=g)
    wild, ref = idx.clone(), idx.clone()
    wild[:, ::2] = pool + torch.arange(8)
    ref[:, ::2] = -1
    o, lse = triton_fp8_partial_attention(q, packed, wild, 0.1, 512)
    ro, rl = f8.fp8_partial_attention(q, packed, ref, 0.1, 512)
    err, lse_err = rel(o, ro), _lse_err(lse, rl)
    assert err < 1e-5 and lse_err < 1e-5, f"past-the-pool indices: {err=:.2e} {lse_err=:.2e}"
    print(f"{len(CASES) + 1} cases ok")


if __name__ == "__main__":
    main()
