"""CUDA-graph capture as the GPU tests do it: one warm-up on a side stream (the allocator's
pools and the kernels' first-call work stay out of the capture), then the capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T, T]:
    """(the graph, the warm-up's outputs, the capture's outputs): replay the graph to fill the
    latter."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, warm, out
