"""K-stream staging pool: the copies that move outgoing partials and fetched pages into send
buffers run on K CUDA streams, so flows overlap their copies instead of queueing on one stream.

A flow's copies are ordered after the work that produced their sources (the caller's current
stream) and return an event; the sender waits on that event (host or stream) before the bytes
leave. Streams are handed out round robin; K = 1 serialises every flow's copies.
"""

from __future__ import annotations

import itertools
import threading

import torch


class StagingPool:
    def __init__(self, streams: int, device: torch.device | str) -> None:
        assert streams > 0, f"{streams=} must be > 0"
        self.device = torch.device(device)
        assert self.device.type == "cuda", f"staging streams need a CUDA device, got {device}"
        self.streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
        self._next = itertools.count()
        self._lock = threading.Lock()

    def stream(self) -> torch.cuda.Stream:
        """The next staging stream, round robin."""
        with self._lock:
            return self.streams[next(self._next) % len(self.streams)]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """``dst.copy_(src)`` for every ``(src, dst)`` on one staging stream, after the caller's
        current stream's work; returns the event that marks them done. Host destinations should
        be pinned, or the copy is synchronous."""
        stream = self.stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def gather(
        self, src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, host: torch.Tensor | None
    ) -> torch.cuda.Event:
        """``dst = src[rows]`` (a fetch's pages into a device send buffer), then, when ``host`` is
        given, ``host.copy_(dst)`` (to a pinned buffer for gRPC), all on one staging stream."""
        stream = self.stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            torch.index_select(src, 0, rows, out=dst)
            if host is not None:
                host.copy_(dst, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done
