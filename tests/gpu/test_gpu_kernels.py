"""Holder kernels (flashmla, triton) against the torch reference ``partial_attention``.

GPU tests (``-m gpu``) need CUDA and skip with the reason elsewhere. The Triton kernel's CPU test
runs it in Triton's interpreter on small shapes (skips when Triton is not installed), so its
indexing, masking, split merge and empty-row handling are checked on every machine.
"""

from __future__ import annotations

import math

import pytest
import torch

from corpusd.kernels.registry import REGISTRY, choose
from tests.support.interpreted import run_interpreted
from tests.support.mla_checks import D_V, D, check, inputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- CPU: Triton in its interpreter ----------------------------------------------------------------


def test_triton_interpreted_matches_reference() -> None:
    """``tests/support/triton_interpreted.py`` in a fresh process: Triton decides at import
    whether its own library functions are interpreted, so the interpreter needs a process of its
    own."""
    run_interpreted("triton_interpreted.py")


def test_auto_picks_torch_on_cpu_and_rejects_gpu_kernels() -> None:
    assert choose("auto", "cpu").name == "torch"
    for name in ("flashmla", "triton"):
        with pytest.raises(ValueError, match="not available on cpu"):
            choose(name, "cpu")


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [1, 16, 64, 128, 160])
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (64, 2048)])
def test_triton_matches_reference_on_gpu(n: int, h: int, k: int) -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, kv, idx = inputs(g, n, h, 5000, k, D, torch.bfloat16, "cuda")
    out = REGISTRY["triton"].fn(q, kv, idx, D**-0.5, D_V)
    check(out, q, kv, idx, D**-0.5, D_V, f"triton {n=} {h=} {k=}")


def _flashmla_or_skip() -> None:
    from corpusd.kernels import flashmla

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashMLA's sparse kernel needs an SM90 GPU (H100/H200)")
    if not flashmla.importable():
        pytest.skip("sgl_kernel.flash_mla is not importable (build .gpu-deps: gpu-deps.sh)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [16, 64, 100, 128, 160, 256])  # past 128: per head group
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (64, 2048)])
def test_flashmla_matches_reference(n: int, h: int, k: int) -> None:
    _flashmla_or_skip()
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, kv, idx = inputs(g, n, h, 5000, k, D, torch.bfloat16, "cuda")
    out = REGISTRY["flashmla"].fn(q, kv, idx, D**-0.5, D_V)
    check(out, q, kv, idx, D**-0.5, D_V, f"flashmla {n=} {h=} {k=}")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [16, 64, 128, 160])
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (32, 2048)])
def test_flashmla_told_each_rows_count_matches_reference(n: int, h: int, k: int) -> None:
    """The compacted streams' kernel (``topk_length``) on rows that are half -1, scattered (one
    holder's share of a top-k) and on the usual rows: the reference's answer either way."""
    _flashmla_or_skip()
    from corpusd.kernels.registry import FLASHMLA_LENGTHS

    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, kv, idx = inputs(g, n, h, 5000, k, D, torch.bfloat16, "cuda")
    half = torch.where(torch.rand(idx.shape, generator=g).to("cuda") < 0.5, idx, -1)
    for rows, what in ((idx, "dense"), (half, "half -1")):
        out = FLASHMLA_LENGTHS.fn(q, kv, rows, D**-0.5, D_V)
        check(out, q, kv, rows, D**-0.5, D_V, f"flashmla+len {what} {n=} {h=} {k=}")


@pytest.mark.gpu
@cuda
def test_flashmla_lse_base_is_detected() -> None:
    _flashmla_or_skip()
    from corpusd.kernels.flashmla import lse_to_natural

    factor = lse_to_natural("cuda:0")
    assert factor in (1.0, math.log(2.0)), f"{factor=}"


@pytest.mark.gpu
@cuda
def test_auto_picks_per_request_for_bf16_and_triton_otherwise() -> None:
    _flashmla_or_skip()
    auto = choose("auto", "cuda:0", torch.bfloat16, D, D_V)
    assert auto.name == "flashmla|triton"
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    for n, h, want in ((64, 128, "flashmla"), (64, 16, "triton"), (4, 64, "triton")):
        assert auto.resolve(n, h).name == want, f"{n=}, {h=}"
        q, kv, idx = inputs(g, n, h, 5000, 256, D, torch.bfloat16, "cuda")
        got, ref = auto.fn(q, kv, idx, D**-0.5, D_V), REGISTRY[want].fn(q, kv, idx, D**-0.5, D_V)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), f"{n=}, {h=}"
    assert choose("auto", "cuda:0", torch.float32, D, D_V).name == "triton"
    with pytest.raises(ValueError, match="does not fit"):
        choose("flashmla", "cuda:0", torch.float32, D, D_V)
