"""Holder kernels (flashmla, triton) against the torch reference ``partial_attention``.

GPU tests (``-m gpu``) need CUDA and skip with the reason elsewhere. The Triton kernel's CPU test
runs it in Triton's interpreter on small shapes (skips when Triton is not installed), so its
indexing, masking, split merge and empty-row handling are checked on every machine.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import rel

from corpusd.model.partial import partial_attention
from holder.kernels import REGISTRY, choose

D, D_V = 576, 512
O_REL, LSE_ABS = 1e-2, 1e-2  # bf16 operands, float32 accumulation (METHOD.md: 1e-3 … 1e-2)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(
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


def _check(
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


# -- CPU: Triton in its interpreter ----------------------------------------------------------------


@pytest.fixture()
def interpreted(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A private copy of ``holder.triton_mla`` whose kernels run in Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton) — the interpreter test needs it")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.runtime.interpreter as interp

    # Triton ≤ 3.5's interpreter calls int() on one-element arrays, an error since numpy 2.4.
    orig = interp._patch_lang_tensor

    def patch(tensor: type) -> None:
        orig(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])  # type: ignore

    monkeypatch.setattr(interp, "_patch_lang_tensor", patch)
    path = Path(__file__).parent.parent / "holder" / "triton_mla.py"
    spec = importlib.util.spec_from_file_location("holder._triton_mla_interpreted", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "n,h,k,dtype,splits",
    [
        (4, 5, 40, torch.float32, None),  # h not a power of two, k not a block multiple
        (3, 16, 64, torch.bfloat16, 2),  # split k, merged by LSE
        (5, 3, 100, torch.bfloat16, 3),  # uneven splits, one of them all padding in row 0
        (3, 17, 33, torch.bfloat16, 1),  # two head blocks
    ],
)
def test_triton_interpreted_matches_reference(
    interpreted: ModuleType, n: int, h: int, k: int, dtype: torch.dtype, splits: int | None
) -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    d_v, d = 32, 48  # the kernel is width-generic; small widths keep the interpreter fast
    q, kv, idx = _inputs(g, n, h, 70, k, d, dtype, "cpu")
    scale = d**-0.5
    out = interpreted.triton_partial_attention(q, kv, idx, scale, d_v, splits=splits)
    _check(out, q, kv, idx, scale, d_v, f"{n=} {h=} {k=} {dtype=} {splits=}")


def test_triton_interpreted_ignores_indices_past_the_pool(interpreted: ModuleType) -> None:
    g = torch.Generator().manual_seed(1)
    q, kv, idx = _inputs(g, 2, 4, 50, 16, 48, torch.float32, "cpu")
    wild = idx.clone()
    wild[:, ::2] = 50 + torch.arange(8)  # past the pool: unused, never read
    ref = idx.clone()
    ref[:, ::2] = -1
    o, lse = interpreted.triton_partial_attention(q, kv, wild, 0.1, 32)
    ro, rl = partial_attention(q, kv, ref, 0.1, 32)
    assert rel(o, ro) < 1e-5 and float((lse - rl).abs().max()) < 1e-5


def test_auto_picks_torch_on_cpu_and_rejects_gpu_kernels() -> None:
    assert choose("auto", "cpu").name == "torch"
    for name in ("flashmla", "triton"):
        with pytest.raises(ValueError, match="not available on cpu"):
            choose(name, "cpu")


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [1, 16, 64, 128])
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (64, 2048)])
def test_triton_matches_reference_on_gpu(n: int, h: int, k: int) -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, kv, idx = _inputs(g, n, h, 5000, k, D, torch.bfloat16, "cuda")
    out = REGISTRY["triton"].fn(q, kv, idx, D**-0.5, D_V)
    _check(out, q, kv, idx, D**-0.5, D_V, f"triton {n=} {h=} {k=}")


def _flashmla_or_skip() -> None:
    from holder import flashmla

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashMLA's sparse kernel needs an SM90 GPU (H100/H200)")
    if not flashmla.importable():
        pytest.skip("sgl_kernel.flash_mla is not importable (build .gpu-deps: gpu-deps.sh)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("h", [16, 64, 100, 128])
@pytest.mark.parametrize("n,k", [(1, 2048), (7, 100), (64, 2048)])
def test_flashmla_matches_reference(n: int, h: int, k: int) -> None:
    _flashmla_or_skip()
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    q, kv, idx = _inputs(g, n, h, 5000, k, D, torch.bfloat16, "cuda")
    out = REGISTRY["flashmla"].fn(q, kv, idx, D**-0.5, D_V)
    _check(out, q, kv, idx, D**-0.5, D_V, f"flashmla {n=} {h=} {k=}")


@pytest.mark.gpu
@cuda
def test_flashmla_lse_base_is_detected() -> None:
    _flashmla_or_skip()
    from holder.flashmla import lse_to_natural

    factor = lse_to_natural("cuda:0")
    assert factor in (1.0, math.log(2.0)), f"{factor=}"


@pytest.mark.gpu
@cuda
def test_auto_prefers_flashmla_for_bf16_and_triton_otherwise() -> None:
    _flashmla_or_skip()
    assert choose("auto", "cuda:0", torch.bfloat16, D, D_V).name == "flashmla"
    assert choose("auto", "cuda:0", torch.float32, D, D_V).name == "triton"
    with pytest.raises(ValueError, match="does not fit"):
        choose("flashmla", "cuda:0", torch.float32, D, D_V)
