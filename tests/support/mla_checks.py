"""Shared checks of a partial-attention kernel against the torch reference (tests and the
interpreter script): random inputs with edge rows, and the tolerances of METHOD.md."""

from __future__ import annotations

import torch

from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel

D, D_V = 576, 512
O_REL, LSE_ABS = 1e-2, 1e-2  # bf16 operands, float32 accumulation (METHOD.md: 1e-3 … 1e-2)


def inputs(
    g: torch.Generator, n: int, h: int, pool: int, k: int, d: int, dtype: torch.dtype, dev: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, pool and indices; row 0 has no valid index, row 1 hits both ends of the pool,
    the last row is half padding (all of them only when n allows)."""
    q = torch.randn(n, h, d, generator=g).to(dtype).to(dev)
    kv = torch.randn(pool, d, generator=g).to(dtype).to(dev)
    idx = torch.randint(0, pool, (n, k), generator=g)
    if n > 2:
        idx[0] = -1
        idx[1, : min(k, 3)] = pool - 1
        idx[1, 3:6] = 0
        idx[-1, k // 2 :] = -1
    return q, kv, idx.to(dev)


def check(
    out: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    d_v: int,
    what: str,
) -> None:
    o, lse = out
    ref_o, ref_lse = partial_attention(q.double(), kv.double(), idx, scale, d_v)
    n, h, _ = q.shape
    assert o.shape == (n, h, d_v) and o.dtype == q.dtype, f"{what}: {o.shape=} {o.dtype=}"
    assert lse.shape == (n, h) and lse.dtype == torch.float32, f"{what}: {lse.shape=}"
    assert not o.isnan().any() and not lse.isnan().any(), f"{what}: NaN in the output"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), f"{what}: -inf rows differ"
    assert float(o[empty].abs().max()) == 0.0 if bool(empty.any()) else True, f"{what}: O ≠ 0"
    full = ~empty
    err = rel(o[full], ref_o[full])
    lse_err = float((lse[full].double() - ref_lse[full]).abs().max())
    assert err < O_REL, f"{what}: rel err of O {err:.2e}"
    assert lse_err < LSE_ABS, f"{what}: max |LSE err| {lse_err:.2e}"
