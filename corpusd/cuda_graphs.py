"""CUDA-graph buckets: capture a GPU function once per bucket of row counts, replay the nearest.

Decode calls the holder's partial (and the requester's merge) with few rows, where a call is
mostly kernel launches (pad, kernel, split merge, LSE fix-up: 4–8 launches of a few µs each).
``GraphBuckets`` captures ``fn`` at every bucket size (largest first) into one shared memory pool
and one set of static input buffers sized for the largest bucket, so the buckets cost the memory
of the largest one. A call copies its ``n`` rows into the static inputs, fills rows ``n…b`` of
the smallest bucket ``b ≥ n`` with each input's pad value (``-1`` indices, ``-inf`` LSE: empty
rows), replays that bucket's graph, and returns views of the first ``n`` rows of its outputs.

Contract: ``fn`` takes tensors whose first dim is the row count and returns a tuple of tensors
whose first dim is the row count; it must be capturable (no host sync, no data-dependent
shapes). Outputs are views into the graph pool: valid until the next call of any bucket; copy
them if they must outlive it. Not thread-safe: one GraphBuckets per stream.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class InputSpec:
    tail: tuple[int, ...]  # shape after the row dim
    dtype: torch.dtype
    pad: float  # value of rows past n (must make them harmless: -1 index, -inf LSE)


class GraphBuckets:
    def __init__(
        self,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        inputs: Sequence[InputSpec],
        device: torch.device | str,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        warmup: int = 2,
    ) -> None:
        assert buckets and sorted(set(buckets)) == list(buckets), f"{buckets=} must ascend"
        self.fn, self.specs, self.buckets = fn, list(inputs), list(buckets)
        self.device = torch.device(device)
        top = self.buckets[-1]
        self.static = [
            torch.full((top, *s.tail), s.pad, dtype=s.dtype, device=self.device) for s in self.specs
        ]
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # compile / autotune / lazy init outside capture
                fn(*[t[: self.buckets[0]] for t in self.static])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for b in reversed(self.buckets):  # largest first: smaller ones reuse its pool blocks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(*[t[:b] for t in self.static])
            self.graphs[b], self.outputs[b] = graph, tuple(out)
        torch.cuda.synchronize(self.device)

    def bucket(self, n: int) -> int:
        """The smallest bucket ≥ n; ValueError when n exceeds the largest."""
        i = bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise ValueError(f"{n} rows exceed the largest graph bucket {self.buckets[-1]}")
        return self.buckets[i]

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replay the nearest bucket for ``args`` (each ``[n, *tail]``); returns ``[n, …]``."""
        n = args[0].shape[0]
        b = self.bucket(n)
        for static, arg, spec in zip(self.static, args, self.specs, strict=True):
            assert arg.shape[0] == n and tuple(arg.shape[1:]) == spec.tail, (
                f"{tuple(arg.shape)=} vs [{n}, *{spec.tail}]"
            )
            static[:n].copy_(arg)
            if b > n:
                static[n:b].fill_(spec.pad)
        self.graphs[b].replay()
        return tuple(o[:n] for o in self.outputs[b])
