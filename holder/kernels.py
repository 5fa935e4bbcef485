"""Partial-attention kernels by name, chosen by capability at start-up.

A kernel computes ``(O, LSE)`` of query rows over pool rows (see ``partial_attention`` for the
contract: natural-log LSE, ``-inf`` and O = 0 for empty rows). The torch reference runs
everywhere; ``flashmla`` (FlashMLA's bf16 sparse kernel: SM90, bf16, d 576 / d_v 512) and
``triton`` (ours: any head count, bf16/fp32) run on CUDA devices and win "auto" there, in that
order, when the pool's dtype and widths fit them. Their modules import lazily, so a CPU-only
install never loads Triton or sgl_kernel.

Where both GPU kernels fit, "auto" returns ``flashmla|triton``: each request runs the one that
measured faster at its row and head count (``prefer_triton``). The choice depends on the request's
shape only, so the gRPC and NVSHMEM paths run the same kernel on the same request and return the
same bits.

A pool of FlashMLA's fp8 rows (``kv_format`` "fp8_e4m3": uint8 ``[N, 656]``, see
``corpusd/model/fp8_cache.py``) is served by the same three names: each kernel's function takes
such a pool where it would take a plain one. "auto" picks FlashMLA's fp8 sparse decode on SM90
when it fits (bf16), else Triton on CUDA, else the torch reference; the per-request split above
was measured for bf16 rows only, so it is not applied to fp8 pools.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from corpusd.model.fp8_cache import fp8_partial_attention
from corpusd.model.partial import partial_attention
from holder import flashmla  # imports sgl_kernel only when first used

KernelFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, int], tuple[torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    fn: KernelFn
    available: Callable[[str], bool]  # device string → usable here?
    priority: int  # higher wins in "auto"
    fits: Callable[[torch.dtype, int, int], bool] = lambda dtype, d, d_v: True  # pool dtype, widths
    pick: Callable[[int, int], Kernel] | None = None  # per request: (rows, heads) → kernel to run
    formats: tuple[str, ...] = ("plain", "fp8_e4m3")  # latent row formats it attends

    def resolve(self, rows: int, heads: int) -> Kernel:
        """The kernel that runs a request of ``rows`` query rows and ``heads`` heads."""
        return self if self.pick is None else self.pick(rows, heads)


REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> None:
    assert kernel.name not in REGISTRY, f"kernel {kernel.name!r} registered twice"
    REGISTRY[kernel.name] = kernel


def _torch(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if kv.dtype == torch.uint8:  # fp8 rows
        return fp8_partial_attention(q, kv, indices, scale, d_v)
    return partial_attention(q, kv, indices, scale, d_v)


def _triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if kv.dtype == torch.uint8:  # fp8 rows
        from holder.triton_mla_fp8 import triton_fp8_partial_attention

        return triton_fp8_partial_attention(q, kv, indices, scale, d_v)
    from corpusd.model.triton_mla import triton_partial_attention

    return triton_partial_attention(q, kv, indices, scale, d_v)


def _triton_usable(device: str) -> bool:
    return (
        device.startswith("cuda")
        and torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
    )


register(Kernel("torch", _torch, lambda device: True, priority=0))
register(Kernel("triton", _triton, _triton_usable, priority=10))
register(
    Kernel(
        "flashmla",
        flashmla.flashmla_partial_attention,
        flashmla.usable,
        priority=20,
        fits=flashmla.fits,
    )
)


# Per-request choice between FlashMLA and Triton, from bench/results/gpu-single-h200.json and
# the 1–64-row sweep in gpu-pair-h200x2.json (`kernel_choice`; H200, k 2048; device µs).
# FlashMLA pads heads to 64 or 128 and has a ~65 µs floor per call; Triton runs the real heads:
# - h = 16: Triton 18 vs 68 at 1 row, 55 vs 90 at 64 rows, and within 6 % of FlashMLA up to
#   952 rows (643 vs 690 batched): Triton at h ≤ 16, whatever the rows.
# - h = 64: Triton 28 vs 66 at 1 row, 39 vs 70 at 16; even at 32 (77 vs 77); FlashMLA 82 vs
#   112 at 38 rows.
# - h = 128: Triton 28 vs 66 at 1 row, 34 vs 67 at 8; even at 16 (72 vs 72); FlashMLA 79 vs
#   117 at 32 rows and at every point above.
# So: Triton at h ≤ 16, or at ≤ 16 rows; FlashMLA otherwise.
TRITON_MAX_HEADS = 16
TRITON_MAX_ROWS = 16  # for h > 16


def prefer_triton(rows: int, heads: int) -> bool:
    """Whether Triton beats (zero-padded) FlashMLA for a request of this shape on SM90."""
    return heads <= TRITON_MAX_HEADS or rows <= TRITON_MAX_ROWS


def per_request(fast_wide: Kernel, fast_narrow: Kernel) -> Kernel:
    """A kernel that runs ``fast_narrow`` (Triton) where ``prefer_triton`` says so, else
    ``fast_wide`` (FlashMLA); named ``"<wide>|<narrow>"``."""

    def pick(rows: int, heads: int) -> Kernel:
        return fast_narrow if prefer_triton(rows, heads) else fast_wide

    def fn(
        q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pick(q.shape[0], q.shape[1]).fn(q, kv, indices, scale, d_v)

    return Kernel(
        f"{fast_wide.name}|{fast_narrow.name}",
        fn,
        lambda device: fast_wide.available(device) and fast_narrow.available(device),
        max(fast_wide.priority, fast_narrow.priority),
        lambda dtype, d, d_v: fast_wide.fits(dtype, d, d_v) and fast_narrow.fits(dtype, d, d_v),
        pick,
        ("plain",),
    )


def choose(
    name: str,
    device: str,
    dtype: torch.dtype | None = None,
    d: int | None = None,
    d_v: int | None = None,
    kv_format: str = "plain",
) -> Kernel:
    """``name`` = a registered kernel or "auto": the highest-priority kernel available on
    ``device`` that fits the pool (``dtype``, query width ``d``, value width ``d_v``; skipped when
    not given; rows in ``kv_format``), or, for plain rows, both GPU kernels chosen per request
    where both fit. Raises ValueError naming the choices when the named kernel is unknown,
    unavailable, or does not fit the pool."""

    def fits(k: Kernel) -> bool:
        shape_ok = dtype is None or d is None or d_v is None or k.fits(dtype, d, d_v)
        return shape_ok and kv_format in k.formats

    if name == "auto":
        usable = {k.name: k for k in REGISTRY.values() if k.available(device) and fits(k)}
        if "flashmla" in usable and "triton" in usable and kv_format == "plain":
            return per_request(usable["flashmla"], usable["triton"])
        return max(usable.values(), key=lambda k: k.priority)
    kernel = REGISTRY.get(name)
    if kernel is None:
        raise ValueError(f"unknown kernel {name!r}; registered: {sorted(REGISTRY)}")
    if not kernel.available(device):
        raise ValueError(f"kernel {name!r} is not available on {device}")
    if not fits(kernel):
        raise ValueError(
            f"kernel {name!r} does not fit a {dtype} pool of width {d} (d_v {d_v}, {kv_format} "
            "rows)"
        )
    return kernel
