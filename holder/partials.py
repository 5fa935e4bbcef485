"""Attend's compute: a kernel's partial attention over pool rows, run on a flow thread.

A CPU holder runs the kernel on rows the servicer already checked. A GPU holder copies q and
the rows in, checks them and runs the kernel on one staging stream, with one host sync; rows
stay in the dtype they came in (int32 from corpusd's requesters), since every kernel and the
device check index with int32 as well as int64.
"""

from __future__ import annotations

import torch

from corpusd.kernels.registry import Kernel
from holder.pool import FramePool, rows_outside
from holder.requests import AttendCall
from holder.staging import StagingPool

#: A kernel's ``PartialOut`` with the device check beside it: (O [n, h, d_v] in the pool's dtype,
#: LSE [n, h] float32, bad [2] bool or None)
Checked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def partial_cpu(pool: FramePool, kernel: Kernel, call: AttendCall) -> Checked:
    """``(O, LSE, None)`` of ``call`` over its layer's pool rows (checked by the servicer)."""
    kv = pool.latent[call.layer]
    o, lse = kernel.fn(call.q.to(pool.geo.dtype), kv, call.rows, call.scale, pool.geo.d_v)
    return o, lse, None


def partial_gpu(pool: FramePool, staging: StagingPool, kernel: Kernel, call: AttendCall) -> Checked:
    """Copy in, check, compute and copy out on one staging stream, with one host sync:
    ``(O, LSE)`` in pinned host memory and ``bad [2]`` (q not finite, rows not the corpus's).
    The kernel never reads outside the pool, so bad rows cost a wasted kernel, never a wrong
    read."""
    kv = pool.latent[call.layer]
    dev = kv.device
    with torch.cuda.device(dev):  # flows run on executor threads
        stream = staging.stream()
        with torch.cuda.stream(stream):
            qd = call.q.to(dev, non_blocking=True)
            rd = call.rows.to(dev, non_blocking=True)
            wrong = rows_outside(pool.row_mask(call.corpus_id, dev), rd)
            bad = torch.stack((~torch.isfinite(qd).all(), wrong))
            o, lse = kernel.fn(qd.to(pool.geo.dtype), kv, rd, call.scale, pool.geo.d_v)
            host = (
                torch.empty(o.shape, dtype=o.dtype, pin_memory=True),
                torch.empty(lse.shape, dtype=lse.dtype, pin_memory=True),
                torch.empty(2, dtype=torch.bool, pin_memory=True),
            )
            for src, dst in zip((o, lse, bad), host, strict=True):
                dst.copy_(src, non_blocking=True)
        stream.synchronize()
    return host
