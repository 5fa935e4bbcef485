"""The LSE merge of two partials in one Triton kernel (CUDA; Triton's interpreter on CPU for the
tests): :func:`corpusd.kernels.merge.merge_partials`'s arithmetic for two parts, element for
element, one read of each O and one write.

Why: the torch merge is about ten kernels over float32 copies of both O's. In a graphed decode
step of corpusd's own worker (``tools/bench_gpu_pair.py``, 32 rows × 128 heads × 512 on H200) it
took 81 µs of the step's 310, as long as the local partial itself. The SGLang plugin's local +
corpus merge (``requester/sglang/lse.py``) runs the same kernel.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: merge_partials keeps its torch ops
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def usable(t: torch.Tensor) -> bool:
    """Whether :func:`merge2` runs for ``t``'s device: CUDA with Triton, or the interpreter."""
    return triton is not None and (t.is_cuda or _INTERPRET)


if triton is not None:

    @triton.jit
    def _merge_kernel(
        oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lout_ptr, d_v,
        s_oan, s_oah, s_obn, s_obh, s_on, s_oh, s_ln, s_lbn, s_lon,
        BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        a = tl.load(la_ptr + row * s_ln + head).to(tl.float32)
        b = tl.load(lb_ptr + row * s_lbn + head).to(tl.float32)
        hi = tl.maximum(a, b)
        lo = tl.minimum(a, b)
        # logaddexp, -inf when both are -inf (as torch.logaddexp)
        total = tl.where(hi == float("-inf"), hi, hi + tl.log(1.0 + tl.exp(lo - hi)))
        ref = tl.where((total == float("inf")) | (total == float("-inf")), 0.0, total)
        wa = tl.exp(a - ref)
        wb = tl.exp(b - ref)
        dv = tl.arange(0, BLOCK_V)
        vm = dv < d_v
        oa = tl.load(oa_ptr + row * s_oan + head * s_oah + dv, mask=vm, other=0.0)
        ob = tl.load(ob_ptr + row * s_obn + head * s_obh + dv, mask=vm, other=0.0)
        o = wa * oa.to(tl.float32) + wb * ob.to(tl.float32)
        tl.store(out_ptr + row * s_on + head * s_oh + dv, o.to(out_ptr.dtype.element_ty), mask=vm)
        tl.store(lout_ptr + row * s_lon + head, total)


def merge2(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_partials([(o_a, lse_a), (o_b, lse_b)])`` in one kernel: O ``[n, h, d_v]`` in
    ``o_a.dtype``, float32 LSE ``[n, h]`` (natural log, -inf empty)."""
    n, h, d_v = o_a.shape
    oa = o_a if o_a.stride(-1) == 1 else o_a.contiguous()
    ob = o_b if o_b.stride(-1) == 1 else o_b.contiguous()
    out = torch.empty_like(oa)
    total = torch.empty(n, h, dtype=torch.float32, device=oa.device)
    la, lb = lse_a.contiguous(), lse_b.contiguous()
    if n and h:
        _merge_kernel[(n, h)](
            oa, la, ob, lb, out, total, d_v,
            oa.stride(0), oa.stride(1), ob.stride(0), ob.stride(1), out.stride(0), out.stride(1),
            la.stride(0), lb.stride(0), total.stride(0),
            BLOCK_V=triton.next_power_of_2(d_v),
        )  # fmt: skip
    return out, total
