"""Partial-attention kernels by name, chosen by capability at start-up.

A kernel computes ``(O, LSE)`` of query rows over pool rows (see ``partial_attention`` for the
contract: natural-log LSE, ``-inf`` and O = 0 for empty rows). The torch reference runs
everywhere; GPU kernels register here (GPU issue) and are chosen when their device is present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corpusd.model.partial import partial_attention

KernelFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, int], tuple[torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    fn: KernelFn
    available: Callable[[str], bool]  # device string → usable here?
    priority: int  # higher wins in "auto"


REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> None:
    assert kernel.name not in REGISTRY, f"kernel {kernel.name!r} registered twice"
    REGISTRY[kernel.name] = kernel


register(Kernel("torch", partial_attention, lambda device: True, priority=0))


def choose(name: str, device: str) -> Kernel:
    """``name`` = a registered kernel or "auto" (the highest-priority one available on device).
    Raises ValueError naming the choices when the named kernel is unknown or unavailable."""
    if name == "auto":
        usable = [k for k in REGISTRY.values() if k.available(device)]
        return max(usable, key=lambda k: k.priority)
    kernel = REGISTRY.get(name)
    if kernel is None:
        raise ValueError(f"unknown kernel {name!r}; registered: {sorted(REGISTRY)}")
    if not kernel.available(device):
        raise ValueError(f"kernel {name!r} is not available on {device}")
    return kernel
