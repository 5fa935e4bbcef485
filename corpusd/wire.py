"""Tensors ↔ ``corpusd.v1.Tensor`` (raw little-endian bytes + shape + dtype), with validation.

Only servicers and clients call this: wire types stop here.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

import torch

from corpusd.v1 import tensor_pb2

assert sys.byteorder == "little", "corpusd's wire format is little-endian; so must the host be"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES = {v: k for k, v in DTYPES.items()}
# from_proto(copy=False) views the message's immutable bytes; callers only read such tensors.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class WireError(ValueError):
    """A malformed tensor in a request; the message names the field and what is wrong."""


def to_proto(t: torch.Tensor) -> tensor_pb2.Tensor:
    t = t.detach().to("cpu").contiguous()
    name = _NAMES.get(t.dtype)
    assert name is not None, f"no wire dtype for {t.dtype}"
    data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return tensor_pb2.Tensor(dtype=name, shape=list(t.shape), data=data)


def from_proto(
    msg: tensor_pb2.Tensor,
    field: str,
    *,
    dtypes: Sequence[torch.dtype],
    rank: int,
    max_bytes: int = 1 << 31,
    finite: bool = False,
    copy: bool = True,
) -> torch.Tensor:
    """Decode and check one tensor field. Raises WireError with ``field`` in the message.
    ``copy=False`` returns a read-only view of the message's bytes (no copy of the payload):
    for tensors that are only read, e.g. copied to a device."""
    if not msg.dtype:
        raise WireError(f"{field}: missing tensor")
    dtype = DTYPES.get(msg.dtype)
    if dtype is None or dtype not in dtypes:
        allowed = ", ".join(_NAMES[d] for d in dtypes)
        raise WireError(f"{field}: dtype {msg.dtype!r} not accepted (expected {allowed})")
    shape = tuple(int(s) for s in msg.shape)
    if len(shape) != rank or any(s < 0 for s in shape):
        raise WireError(f"{field}: shape {list(shape)} is not a rank-{rank} shape")
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > max_bytes:
        raise WireError(f"{field}: {nbytes:,} bytes exceeds the limit of {max_bytes:,}")
    data = msg.data  # each read of a bytes field copies the payload out of the message
    if len(data) != nbytes:
        raise WireError(f"{field}: {len(data):,} data bytes for shape {list(shape)} {msg.dtype}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(data) if copy else data
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    if finite and t.is_floating_point() and not all_finite(t):
        raise WireError(f"{field}: contains NaN or infinite values")
    return t


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or ±inf in ``t``: min and max propagate NaN, so one fused reduction (on CPU ~25×
    faster than ``isfinite(t).all()``, which materialises a bool tensor)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
