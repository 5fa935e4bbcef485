"""NVSHMEM data plane: one job per holder (rank 0) and its requesters (ranks 1…peers), and a
symmetric ring of request / reply slots per requester.

Every member allocates the same symmetric buffers (allocation is collective):

- ``req [peers, depth, req_bytes]`` u8: requester r packs a request into its own copy of
  ``req[r-1, slot]`` and ``put_signal``s it into the holder's copy, setting ``req_sig[r-1]`` to
  the request's sequence number;
- ``rep [peers, depth, rep_bytes]`` u8: the holder packs the reply into its own copy of
  ``rep[r-1, slot]`` and ``put_signal``s it into requester r's copy, setting ``rep_sig[r-1]``.

Everything is stream-ordered (``*_on_stream``): the requester's stream waits for the reply
signal, and the holder's stream waits for the request signal before its kernel; no host is in
the data path. Slot ``seq % depth`` is reused only after reply ``seq - depth`` came back, which
the requester's stream order guarantees. Sequence numbers start at 1 (signals start at 0).

Packing (a request of ``n`` rows, ``h`` heads, ``k`` indices; a reply):
``attend`` request ``q [n, h, 576] bf16 ‖ idx [n, k] int32``, reply
``O [n, h, 512] bf16 ‖ LSE [n, h] f32 ‖ status i32``; ``fetch`` request ``rows [n] int32``,
reply ``pages [n, 576] bf16 ‖ status``; ``echo`` replies ``echo_bytes`` untouched bytes.

Across nodes the same code runs over IBGDA; only the environment changes (see the README):
``NVSHMEM_REMOTE_TRANSPORT=ibrc`` (the default), ``NVSHMEM_IB_ENABLE_IBGDA=1``,
``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=<control-plane interface>``; always
``NVSHMEM_DISABLE_NVLS=1``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

import torch

from corpusd.kernels.formats import D_QK, D_V

UID_BYTES = 128
ENV_DEFAULTS = {
    "NVSHMEM_DISABLE_NVLS": "1",  # NVLink multicast can take the host's GPUs down: never on
    "NVSHMEM_REMOTE_TRANSPORT": "none",  # one node; set ibrc (+ IBGDA) across nodes
    "NVSHMEM_SYMMETRIC_SIZE": "4G",
}


log = logging.getLogger("corpusd.nvshmem")


def setup_env() -> None:
    """NVSHMEM's environment defaults (an explicit setting wins); before any NVSHMEM call."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _core():
    import nvshmem.core

    return nvshmem.core


def _bindings():
    import nvshmem.bindings

    return nvshmem.bindings


def available() -> bool:
    """nvshmem4py importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        _core()
    except Exception:
        return False
    return True


def new_uid() -> bytes:
    """A fresh unique id (rank 0 only), as the raw bytes that travel over the control plane."""
    setup_env()
    uid = _core().get_unique_id()
    return ctypes.string_at(uid.ptr, UID_BYTES)


@dataclass(frozen=True, slots=True)
class RingGeometry:
    peers: int
    depth: int
    req_bytes: int
    rep_bytes: int

    def __post_init__(self) -> None:
        assert self.peers > 0 and self.depth > 0, f"{self=}"
        assert self.req_bytes % 16 == 0 and self.rep_bytes % 16 == 0, f"{self=}: 16-byte slots"

    @staticmethod
    def for_shapes(
        peers: int, depth: int, rows: int, heads: int, topk: int, fetch_rows: int
    ) -> RingGeometry:
        """Slots big enough for attend requests up to ``rows × heads × topk`` and fetch replies
        up to ``fetch_rows`` pool rows."""
        req = max(attend_request_bytes(rows, heads, topk), fetch_rows * 4)
        rep = max(attend_reply_bytes(rows, heads), fetch_rows * D_QK * 2 + 16)
        return RingGeometry(peers, depth, _align(req), _align(rep))


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def attend_request_bytes(n: int, h: int, k: int) -> int:
    return _align(n * h * D_QK * 2) + n * k * 4


def attend_reply_bytes(n: int, h: int) -> int:
    return n * h * D_V * 2 + n * h * 4 + 4


def attend_request_views(slot: torch.Tensor, n: int, h: int, k: int) -> tuple[torch.Tensor, ...]:
    """``(q [n, h, 576] bf16, idx [n, k] int32)`` views of a request slot (u8)."""
    qb = n * h * D_QK * 2
    q = slot[:qb].view(torch.bfloat16).view(n, h, D_QK)
    off = _align(qb)
    idx = slot[off : off + n * k * 4].view(torch.int32).view(n, k)
    return q, idx


def attend_reply_views(slot: torch.Tensor, n: int, h: int) -> tuple[torch.Tensor, ...]:
    """``(O [n, h, 512] bf16, LSE [n, h] f32, status [1] int32)`` views of a reply slot."""
    ob = n * h * D_V * 2
    o = slot[:ob].view(torch.bfloat16).view(n, h, D_V)
    lse = slot[ob : ob + n * h * 4].view(torch.float32).view(n, h)
    status = slot[ob + n * h * 4 : ob + n * h * 4 + 4].view(torch.int32)
    return o, lse, status


def store(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst = src`` with SM stores (an elementwise kernel, not a copy-engine memcpy): into a
    peer mapping that is the fast way over NVLink, and exact (× 1 changes no value)."""
    if dst.dtype.is_floating_point:
        torch.mul(src, 1, out=dst)
    else:
        torch.add(src, 0, out=dst)


def fetch_reply_views(slot: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pb = n * D_QK * 2
    return slot[:pb].view(torch.bfloat16).view(n, D_QK), slot[pb : pb + 4].view(torch.int32)


class Job:
    """This process's membership of one NVSHMEM job and the ring every member allocated.

    ``Job(uid, rank, nranks, device, ring)`` initialises NVSHMEM (collective: every rank must
    call it with the same uid) and allocates the ring (collective too). ``close()`` frees and
    finalises (collective)."""

    def __init__(self, uid: bytes, rank: int, nranks: int, device: int, ring: RingGeometry) -> None:
        from cuda.core import Device

        setup_env()
        assert len(uid) == UID_BYTES, f"uid must be {UID_BYTES} bytes, got {len(uid)}"
        assert 0 <= rank < nranks and nranks == ring.peers + 1, f"{rank=} {nranks=} {ring=}"
        core = _core()
        torch.cuda.set_device(device)
        torch.empty(1, device=f"cuda:{device}")  # start the runtime: init does not
        dev = Device(device)
        dev.set_current()
        u = core.get_unique_id(empty=True)
        ctypes.memmove(u.ptr, uid, UID_BYTES)
        core.init(device=dev, uid=u, rank=rank, nranks=nranks, initializer_method="uid")
        self.rank, self.nranks, self.ring = rank, nranks, ring
        self.device = torch.device("cuda", device)
        g = ring
        self.req = core.tensor((g.peers, g.depth, g.req_bytes), dtype=torch.uint8)
        self.rep = core.tensor((g.peers, g.depth, g.rep_bytes), dtype=torch.uint8)
        self.req_sig = core.tensor((g.peers,), dtype=torch.int64)
        self.rep_sig = core.tensor((g.peers,), dtype=torch.int64)
        self.req_sig.zero_()
        self.rep_sig.zero_()
        torch.cuda.synchronize(self.device)
        core.barrier_all(stream=torch.cuda.current_stream(self.device))
        torch.cuda.synchronize(self.device)
        b = _bindings()
        self._set = int(b.Signal_op.SIGNAL_SET)
        self._add = int(b.Signal_op.SIGNAL_ADD)
        self._ge = int(b.Cmp_type.CMP_GE)

    # -- stream-ordered primitives ---------------------------------------------------------------
    def put_signal(
        self,
        dst_src: torch.Tensor,
        nbytes: int,
        sig: torch.Tensor,
        value: int,
        pe: int,
        s: int,
        add: bool = False,
    ) -> None:
        """Put ``nbytes`` of our copy of symmetric ``dst_src`` into PE ``pe``'s copy, then set
        its ``sig`` to ``value`` (``add``: add ``value``); the bytes land before the signal."""
        assert nbytes <= dst_src.numel() * dst_src.element_size(), f"{nbytes=} past the slot"
        p = dst_src.data_ptr()
        op = self._add if add else self._set
        _bindings().putmem_signal_on_stream(p, p, nbytes, sig.data_ptr(), value, op, pe, s)

    def wait_ge(self, sig: torch.Tensor, value: int, s: int) -> None:
        """Stream ``s`` waits until our copy of ``sig`` ≥ ``value``."""
        _bindings().signal_wait_until_on_stream(sig.data_ptr(), self._ge, value, s)

    def signal(self, sig: torch.Tensor, value: int, pe: int, s: int, add: bool = False) -> None:
        """Set (``add``: add to) PE ``pe``'s copy of ``sig``, in stream order."""
        op = self._add if add else self._set
        _bindings().signal_op_on_stream(sig.data_ptr(), value, op, pe, s)

    def peer(self, t: torch.Tensor, pe: int) -> torch.Tensor | None:
        """PE ``pe``'s copy of symmetric ``t`` mapped into this process (NVLink, same node), or
        None when it cannot be mapped (another node: use put_signal)."""
        try:
            view = _core().get_peer_tensor(t, pe)
        except Exception:
            return None
        return view if view is not None and view.data_ptr() != 0 else None

    def close(self, timeout_s: float | None = None) -> bool:
        """Free the ring and finalise: collective, so it returns once every member closed too.
        With ``timeout_s``, give up waiting after that long (a member that died, or streams
        parked on requests that never came) and return False: the job is abandoned, and the
        process should exit rather than use NVSHMEM again."""

        def teardown() -> None:
            core = _core()
            torch.cuda.synchronize(self.device)
            core.barrier_all(stream=torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)
            for t in (self.req, self.rep, self.req_sig, self.rep_sig):
                core.free_tensor(t)
            core.finalize()

        if timeout_s is None:
            teardown()
            return True
        t = threading.Thread(target=teardown, name="nvshmem-close", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            log.warning("NVSHMEM job not closed within %.0f s (a member is gone?); abandoned",
                        timeout_s)  # fmt: skip
            return False
        return True
