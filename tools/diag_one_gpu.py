"""Two processes on one GPU: what works for a holder that shares the SGLang worker's GPU (issue 17,
item 2). Two checks, each in fresh processes, each with a deadline, results as JSON lines:

1. ``nvshmem``: an NVSHMEM job of two PEs on the same device (``transport.nvshmem_ring.Job``, UID
   bootstrap): init, the ring's collective allocation, one ``put_signal`` from PE 0 that PE 1
   waits for and checks, then the collective close.
2. ``ipc-lifetime``: the device path's CUDA IPC mapping when the exporting process exits: the
   exporter fills a tensor, shares it (``transport.cuda_ipc``), the importer maps it, the
   exporter exits, and the importer reads it again (a holder that dies under an SGLang worker
   that still has its pool mapped).

GPU machine, with nvshmem4py on the path (``.gpu-deps/site``)::

    NVSHMEM_DISABLE_NVLS=1 python -m tools.diag_one_gpu
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from typing import Any

DEADLINE_S = 90


def _nvshmem_pe(rank: int, uid_q: Any, out_q: Any) -> None:
    try:
        import torch

        from corpusd.transport import nvshmem_ring as nr

        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        uid = nr.new_uid() if rank == 0 else uid_q.get(timeout=60)
        if rank == 0:
            uid_q.put(uid)
        t0 = time.perf_counter()
        job = nr.Job(uid, rank, 2, 0, nr.RingGeometry(1, 1, 256, 256))
        init_s = time.perf_counter() - t0
        s = torch.cuda.current_stream().cuda_stream
        if rank == 0:
            job.req[0, 0].copy_(torch.arange(256, dtype=torch.uint8, device="cuda"))
            job.put_signal(job.req[0, 0], 256, job.req_sig, 1, 1, s)
            torch.cuda.synchronize()
            got = "sent"
        else:
            job.wait_ge(job.req_sig, 1, s)
            torch.cuda.synchronize()
            want = torch.arange(256, dtype=torch.uint8, device="cuda")
            got = "received, equal" if torch.equal(job.req[0, 0], want) else "received, WRONG"
        closed = job.close(timeout_s=30)
        out_q.put({"check": "nvshmem", "rank": rank, "ok": True, "init_s": round(init_s, 2),
                   "result": got, "closed": closed})  # fmt: skip
    except BaseException as e:
        out_q.put({"check": "nvshmem", "rank": rank, "ok": False,
                   "error": f"{type(e).__name__}: {e}"[:800],
                   "where": traceback.format_exc()[-1200:]})  # fmt: skip


def _exporter(share_q: Any, go_q: Any) -> None:
    import torch

    from corpusd.transport import cuda_ipc

    t = torch.full((1 << 20,), 7.0, device="cuda:0")
    torch.cuda.synchronize()
    share_q.put(cuda_ipc.share(t))
    go_q.get(timeout=60)  # the importer has mapped it: exit (and the pool with the process)


def _importer(share_q: Any, go_q: Any, out_q: Any, exporter: Any) -> None:
    try:
        import torch

        from corpusd.transport import cuda_ipc

        torch.cuda.set_device(0)
        t = cuda_ipc.open_shared(share_q.get(timeout=60))
        before = float(t.sum())
        go_q.put(1)
        exporter.join(timeout=60)
        time.sleep(1.0)
        after = float(t.sum())  # read after the exporter's exit
        torch.cuda.synchronize()
        out_q.put({"check": "ipc-lifetime", "ok": True, "exporter_exit": exporter.exitcode,
                   "sum_before": before, "sum_after_exit": after})  # fmt: skip
    except BaseException as e:
        out_q.put({"check": "ipc-lifetime", "ok": False, "error": f"{type(e).__name__}: {e}"[:800]})


def main() -> None:
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    uid_q: Any = ctx.Queue()
    pes = [ctx.Process(target=_nvshmem_pe, args=(r, uid_q, out)) for r in (0, 1)]
    for p in pes:
        p.start()
    for p in pes:
        p.join(timeout=DEADLINE_S)
    for r, p in enumerate(pes):
        if p.is_alive():
            p.kill()
            out.put({"check": "nvshmem", "rank": r, "ok": False, "error": f"hung > {DEADLINE_S} s"})
    share_q: Any = ctx.Queue()
    go_q: Any = ctx.Queue()
    exp = ctx.Process(target=_exporter, args=(share_q, go_q))
    exp.start()
    _importer(share_q, go_q, out, exp)
    time.sleep(0.5)
    while not out.empty():
        print(json.dumps(out.get()), flush=True)


if __name__ == "__main__":
    main()
