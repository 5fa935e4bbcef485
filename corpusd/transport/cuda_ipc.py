"""Same-host transport: a holder's frame pool mapped into a requester process by CUDA IPC.

When the holder and the requester run on one GPU, nothing needs to move: the requester maps the
holder's per-layer latent pools (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``, through
torch's own sharing of CUDA storages) and runs the sparse partial over the holder's frames on
its own stream, so the call can be captured in the requester's CUDA graph. A cross-process ring
(the requester waits on the device for a kernel the holder launches) does not work well here:
two processes on one GPU without MPS are time-sliced, so a spinning wait in one process holds
the GPU from the other for a whole time slice.

On another GPU of the host the same mapping works over peer access (:func:`open_shared`'s
``on``): the requester's kernels read the holder's rows across NVLink, a sparse read of only
the selected rows, with nothing running in the holder's process. It costs the selected rows'
bytes over the link per step (route would send the query instead), and needs both GPUs visible
to the requester (``CUDA_VISIBLE_DEVICES``).

What the requester gets is read-only by contract: the holder still owns the frames, assigns and
releases them, and a requester reads only rows its page table (from the holders' reports) names.
The mapping lives as long as both processes do; the holder keeps its pools allocated for its
whole life (preallocated at start), so the addresses a CUDA graph captured stay valid until the
holder exits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corpusd.v1 import holder_pb2


@dataclass(frozen=True, slots=True)
class SharedTensor:
    """One CUDA tensor as another process on the same host opens it. ``handle`` fields are the
    ones ``torch.UntypedStorage._share_cuda_`` returns (an IPC memory handle of the storage's
    allocation, the offset into it, and torch's cross-process reference counter)."""

    device_uuid: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    storage_offset: int  # elements
    handle: bytes
    alloc_bytes: int
    alloc_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool


def device_uuid(device: torch.device | str | int) -> str:
    """The GPU's UUID (stable across processes, unlike its index under CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def share(t: torch.Tensor) -> SharedTensor:
    """Export contiguous CUDA tensor ``t``. The exporting process must keep ``t`` alive for as
    long as an importer uses it. Raises ValueError for a CPU or non-contiguous tensor."""
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"share needs a contiguous CUDA tensor, got {t.device} {t.stride()=}")
    st = t.untyped_storage()
    (_, handle, size, offset, ref, ref_off, event, sync) = st._share_cuda_()
    return SharedTensor(
        device_uuid=device_uuid(t.device),
        shape=tuple(t.shape),
        dtype=str(t.dtype).removeprefix("torch."),
        storage_offset=int(t.storage_offset()),
        handle=bytes(handle),
        alloc_bytes=int(size),
        alloc_offset=int(offset),
        ref_counter=bytes(ref),
        ref_counter_offset=int(ref_off),
        event=bytes(event) if event else b"",
        event_sync=bool(sync),
    )


def local_device(uuid: str) -> int | None:
    """Index of the visible GPU with ``uuid``, or None when this process cannot see it."""
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


def peer_reachable(here: int, uuid: str) -> bool:
    """Whether this process's GPU ``here`` reads GPU ``uuid``'s memory directly: the same GPU,
    or another visible GPU of this host with peer access to it (NVLink or PCIe P2P)."""
    there = local_device(uuid)
    if there is None:
        return False
    return there == here or bool(torch.cuda.can_device_access_peer(here, there))


def open_shared(s: SharedTensor, on: int | None = None) -> torch.Tensor:
    """Map ``s`` into this process: a tensor of its shape and dtype over the exporter's memory.
    ``on``: the GPU to map it onto (default the exporter's). Mapped onto another GPU than the
    exporter's, the memory stays where it is and the tensor is that GPU's: its kernels read
    the rows over peer access (``cudaIpcMemLazyEnablePeerAccess``, which torch's open passes),
    so a kernel on ``on``'s stream, or a graph captured there, reads it like its own memory.
    Raises ValueError when this process cannot see the exporter's GPU, or ``on`` cannot reach
    it (:func:`peer_reachable`)."""
    there = local_device(s.device_uuid)
    if there is None:
        raise ValueError(f"GPU {s.device_uuid} is not visible to this process")
    dev = there if on is None else on
    if not peer_reachable(dev, s.device_uuid):
        raise ValueError(f"GPU {dev} has no peer access to GPU {there} ({s.device_uuid})")
    with torch.cuda.device(dev):
        storage = torch.UntypedStorage._new_shared_cuda(
            dev,
            s.handle,
            s.alloc_bytes,
            s.alloc_offset,
            s.ref_counter,
            s.ref_counter_offset,
            s.event or None,
            s.event_sync,
        )
        dtype = getattr(torch, s.dtype)
        out = torch.empty(0, dtype=dtype, device=f"cuda:{dev}")
        stride = torch.empty(s.shape, device="meta").stride()
        out.set_(storage, s.storage_offset, s.shape, stride)
    return out


def to_wire(s: SharedTensor) -> holder_pb2.SharedTensor:
    return holder_pb2.SharedTensor(
        device_uuid=s.device_uuid,
        shape=list(s.shape),
        dtype=s.dtype,
        storage_offset=s.storage_offset,
        handle=s.handle,
        alloc_bytes=s.alloc_bytes,
        alloc_offset=s.alloc_offset,
        ref_counter=s.ref_counter,
        ref_counter_offset=s.ref_counter_offset,
        event=s.event,
        event_sync=s.event_sync,
    )


def from_wire(m: holder_pb2.SharedTensor) -> SharedTensor:
    return SharedTensor(
        device_uuid=m.device_uuid,
        shape=tuple(int(x) for x in m.shape),
        dtype=m.dtype,
        storage_offset=m.storage_offset,
        handle=m.handle,
        alloc_bytes=m.alloc_bytes,
        alloc_offset=m.alloc_offset,
        ref_counter=m.ref_counter,
        ref_counter_offset=m.ref_counter_offset,
        event=m.event,
        event_sync=m.event_sync,
    )
