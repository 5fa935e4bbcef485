"""Partial-attention kernels by name, chosen by capability at start-up.

A kernel computes ``(O, LSE)`` of query rows over pool rows (see ``partial_attention`` for the
contract: natural-log LSE, ``-inf`` and O = 0 for empty rows). The torch reference runs
everywhere; ``flashmla`` (FlashMLA's bf16 sparse kernel: SM90, bf16, d 576 / d_v 512) and
``triton`` (ours: any head count, bf16/fp32) run on CUDA devices and win "auto" there, in that
order, when the pool's dtype and widths fit them. Their modules import lazily, so a CPU-only
install never loads Triton or sgl_kernel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> None:
    assert kernel.name not in REGISTRY, f"kernel {kernel.name!r} registered twice"
    REGISTRY[kernel.name] = kernel


def _triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from holder.triton_mla import triton_partial_attention

    return triton_partial_attention(q, kv, indices, scale, d_v)


def _triton_usable(device: str) -> bool:
    return (
        device.startswith("cuda")
        and torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
    )


register(Kernel("torch", partial_attention, lambda device: True, priority=0))
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


def choose(
    name: str,
    device: str,
    dtype: torch.dtype | None = None,
    d: int | None = None,
    d_v: int | None = None,
) -> Kernel:
    """``name`` = a registered kernel or "auto": the highest-priority kernel available on
    ``device`` that fits the pool (``dtype``, query width ``d``, value width ``d_v``; skipped when
    not given). Raises ValueError naming the choices when the named kernel is unknown,
    unavailable, or does not fit the pool."""

    def fits(k: Kernel) -> bool:
        return dtype is None or d is None or d_v is None or k.fits(dtype, d, d_v)

    if name == "auto":
        usable = [k for k in REGISTRY.values() if k.available(device) and fits(k)]
        return max(usable, key=lambda k: k.priority)
    kernel = REGISTRY.get(name)
    if kernel is None:
        raise ValueError(f"unknown kernel {name!r}; registered: {sorted(REGISTRY)}")
    if not kernel.available(device):
        raise ValueError(f"kernel {name!r} is not available on {device}")
    if not fits(kernel):
        raise ValueError(f"kernel {name!r} does not fit a {dtype} pool of width {d} (d_v {d_v})")
    return kernel
