"""What a device can run, asked once per device: its SM generation, its SM count, and whether
Triton can launch there. Cached, so a kernel may ask inside a CUDA-graph capture."""

from __future__ import annotations

import importlib.util
from functools import cache

import torch


def _key(device: str | torch.device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


@cache
def _props(key: str) -> tuple[int, int]:
    d = torch.device(key)
    if d.type != "cuda" or not torch.cuda.is_available():
        return 0, 0
    p = torch.cuda.get_device_properties(d)
    return p.major, p.multi_processor_count


def sm_major(device: str | torch.device) -> int:
    """The CUDA compute capability's major number (9: H100/H200, 10: B200); 0 off CUDA."""
    return _props(_key(device))[0]


def sm_count(device: str | torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 off CUDA."""
    return _props(_key(device))[1]


def triton_usable(device: str | torch.device) -> bool:
    """A CUDA device with Triton installed (the interpreter is the tests' business)."""
    return (
        torch.device(device).type == "cuda"
        and torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
    )
