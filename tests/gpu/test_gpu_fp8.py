"""Kernels over FlashMLA's fp8 rows (``corpusd/kernels/fp8_cache.py``) against the fp8 torch
reference ``fp8_partial_attention``: Triton (in its CPU interpreter here, compiled on a GPU) and
FlashMLA's fp8 sparse decode (``flash_mla_with_kvcache(is_fp8_kvcache=True, indices=…)``, SM90).

GPU tests (``-m gpu``) need CUDA and skip with the reason elsewhere. Inputs follow FlashMLA's
test style: every row valid except an empty row, a half-padded row, rows at both ends of the
pool, and sentinel values (NaN) in pool rows no index selects, so an out-of-bounds read shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from corpusd.kernels import fp8_cache as f8
from corpusd.kernels.registry import REGISTRY, choose
from tests.support.interpreted import run_interpreted
from tests.support.mla_checks import rel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
D, D_V, SCALE = 576, 512, 576**-0.5


def _fp8_inputs(
    g: torch.Generator, n: int, h: int, pool: int, k: int, dev: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 q ``[n, h, 576]``, fp8 pool ``[pool, 656]`` (pool a multiple of 64, its last 64 rows
    never selected and poisoned with NaN codes), indices ``[n, k]`` with the edge rows."""
    lat = torch.randn(pool, D, generator=g) * torch.exp2(torch.randint(-2, 3, (pool, 1)))
    packed = f8.quantize(lat.bfloat16())
    packed[-64:, :512] = 0x7F  # e4m3fn NaN: any read of these rows poisons the output
    q = torch.randn(n, h, D, generator=g).bfloat16()
    idx = torch.randint(0, pool - 64, (n, k), generator=g)
    if n > 2:
        idx[0] = -1
        idx[1, : min(k, 3)] = pool - 65
        idx[1, 3:6] = 0
        idx[-1, k // 2 :] = -1
    return q.to(dev), packed.to(dev), idx.to(dev)


def _check(out: tuple[torch.Tensor, torch.Tensor], q, packed, idx, what: str) -> None:  # type: ignore[no-untyped-def]
    """O within 1e-2 relative and LSE within 1e-2 of the reference (bf16 operands, float32
    accumulation), empty rows exactly O = 0 / LSE = -inf, no NaN."""
    o, lse = out
    ro, rl = f8.fp8_partial_attention(q.float().cpu(), packed.cpu(), idx.cpu(), SCALE, D_V)
    o, lse = o.float().cpu(), lse.cpu()
    n, h, _ = q.shape
    assert o.shape == (n, h, D_V) and lse.shape == (n, h), f"{what}: {o.shape=} {lse.shape=}"
    assert not o.isnan().any() and not lse.isnan().any(), f"{what}: NaN (a poisoned row read?)"
    empty = torch.isneginf(rl)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: -inf rows differ"
    assert bool((o[empty] == 0).all()), f"{what}: an empty row has O ≠ 0"
    err, lse_err = rel(o[~empty], ro[~empty]), float((lse[~empty] - rl[~empty]).abs().max())
    assert err < 1e-2 and lse_err < 1e-2, f"{what}: O rel {err:.2e}, |LSE err| {lse_err:.2e}"


# -- CPU -------------------------------------------------------------------------------------------


def test_triton_fp8_interpreted_matches_reference() -> None:
    """``tests/support/triton_fp8_interpreted.py`` in a fresh process (Triton decides at import
    whether its library functions are interpreted)."""
    run_interpreted("triton_fp8_interpreted.py")


def test_torch_kernel_serves_fp8_pools_on_cpu() -> None:
    kernel = choose("auto", "cpu", torch.float32, D, D_V, "fp8_e4m3")
    assert kernel.name == "torch"
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, packed, idx = _fp8_inputs(g, 5, 8, 256, 64, "cpu")
    o, lse = kernel.fn(q.float(), packed, idx, SCALE, D_V)
    ro, rl = f8.fp8_partial_attention(q.float(), packed, idx, SCALE, D_V)
    assert torch.equal(o, ro) and torch.equal(lse, rl)


# -- GPU -------------------------------------------------------------------------------------------


def _flashmla_or_skip() -> None:
    from corpusd.kernels import flashmla

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashMLA's fp8 sparse decode needs an SM90 GPU (H100/H200)")
    if not flashmla.importable():
        pytest.skip("sgl_kernel.flash_mla is not importable (build .gpu-deps: gpu-deps.sh)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [1, 16, 64, 128])
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (64, 2048)])
def test_triton_fp8_matches_reference_on_gpu(n: int, h: int, k: int) -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, packed, idx = _fp8_inputs(g, n, h, 5056, k, "cuda")
    out = REGISTRY["triton"].fn(q, packed, idx, SCALE, D_V)
    _check(out, q, packed, idx, f"triton fp8 {n=} {h=} {k=}")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [16, 64, 100, 128])
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (64, 2048)])
def test_flashmla_fp8_decode_matches_reference(n: int, h: int, k: int) -> None:
    """FlashMLA's own fp8 sparse decode (the kernel SGLang's flashmla_kv path runs) against the
    torch reference that dequantizes as ``fp8_cache`` documents."""
    _flashmla_or_skip()
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, packed, idx = _fp8_inputs(g, n, h, 5056, k, "cuda")
    out = REGISTRY["flashmla"].fn(q, packed, idx, SCALE, D_V)
    _check(out, q, packed, idx, f"flashmla fp8 {n=} {h=} {k=}")


@pytest.mark.gpu
@cuda
def test_flashmla_fp8_lse_base_and_auto_choice() -> None:
    _flashmla_or_skip()
    from corpusd.kernels.flashmla import lse_to_natural

    assert lse_to_natural("cuda:0", fp8=True) in (1.0, math.log(2.0))
    assert choose("auto", "cuda:0", torch.bfloat16, D, D_V, "fp8_e4m3").name == "flashmla"
    assert choose("auto", "cuda:0", torch.float32, D, D_V, "fp8_e4m3").name == "triton"


@pytest.mark.gpu
@cuda
def test_quantize_agrees_with_sglangs_quantizer_on_gpu() -> None:
    """Our bytes against SGLang's own ``quantize_k_cache`` (its Triton kernel) on bf16 rows,
    where SGLang is installed (the CPU test checks an independent IEEE re-implementation).
    Triton divides float32 approximately (``div.full.f32``, within 2 ulp) where we divide
    exactly, so the claim is: rope bytes equal, scales within 2 ulp, codes at most one step
    apart and equal in more than 99 % of places."""
    try:
        from sglang.srt.layers.attention.nsa.quant_k_cache import quantize_k_cache
    except Exception as e:  # not installed, or a build without the NSA backend
        pytest.skip(f"sglang's quantize_k_cache is not importable: {type(e).__name__}: {e}")
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    lat = torch.randn(4096, D, generator=g) * torch.exp2(torch.randint(-6, 6, (4096, 1)))
    lat = lat.bfloat16().cuda()
    theirs = quantize_k_cache(lat.view(64, 64, 1, D)).view(torch.uint8).reshape(4096, -1).cpu()
    ours = f8.quantize(lat).cpu()
    assert torch.equal(theirs[:, 528:], ours[:, 528:]), "rope bytes differ"
    scales = [x[:, 512:528].contiguous().view(torch.int32) for x in (theirs, ours)]
    ulps = (scales[0] - scales[1]).abs()
    assert int(ulps.max()) <= 2, f"scales {int(ulps.max())} ulp apart"
    a, b = theirs[:, :512].int(), ours[:, :512].int()
    zero = (a & 0x7F == 0) & (b & 0x7F == 0)  # +0 and -0
    step = torch.where(zero, 0, (a - b).abs())
    same = float((step == 0).float().mean())
    assert int(step.max()) <= 1 and same > 0.99, f"codes: max step {int(step.max())}, {same=:.4f}"
