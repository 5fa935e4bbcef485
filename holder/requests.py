"""Holder requests decoded and checked at the edge: wire messages become tensors and ints, and
every malformed or impossible request becomes a ``Reject`` naming the field, before it reaches
the admission queue or the pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import torch

from corpusd.model.config import MAX_HEADS
from corpusd.rpc import Reject, wire
from corpusd.v1 import holder_pb2
from corpusd.wire import from_proto
from holder.config import HolderConfig
from holder.pool import FramePool, HeldCorpus, RowError
from indexer import ARITHS

S = grpc.StatusCode
FLOATS = (torch.float32, torch.bfloat16)
INTS = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class AttendCall:
    """A checked Attend: ``q [n, h, kv_dim]`` float32/bf16 and ``rows [n, k]`` pool rows as
    sent (int32 from corpusd's requesters; int64 accepted), ``-1`` = unused slot. On a GPU
    holder both are read-only views of the request's bytes, and q's values and the rows are
    checked on the device (``rows_outside``); on a CPU holder they were checked here."""

    corpus_id: str
    layer: int
    q: torch.Tensor
    rows: torch.Tensor
    scale: float


@dataclass(frozen=True, slots=True)
class TopKCall:
    """A checked IndexTopK: ``q [n, H_I, index_dim]``, ``weights [n, H_I]``, ``limit [n]``
    (positions ≥ limit are masked), ``0 < k ≤ max_k``, ``arith`` one of ``ARITHS``."""

    corpus_id: str
    layer: int
    q: torch.Tensor
    weights: torch.Tensor
    limit: torch.Tensor
    k: int
    arith: str


class RequestChecks:
    """Decodes and checks requests against this holder's limits and pool; raises Reject."""

    def __init__(self, cfg: HolderConfig, pool: FramePool) -> None:
        self.cfg, self.pool = cfg, pool

    def held(self, corpus_id: str) -> HeldCorpus:
        held = self.pool.held(corpus_id)
        if held is None:
            raise Reject(S.NOT_FOUND, f"corpus {corpus_id!r} is not held by this holder")
        return held

    def layer(self, layer: int) -> int:
        n = self.pool.geo.n_layers
        if layer >= n:
            raise Reject(
                S.OUT_OF_RANGE, f"layer {layer} out of range: the model has layers 0..{n - 1}"
            )
        return layer

    def tensor(
        self,
        msg: Any,
        name: str,
        dtypes: tuple[torch.dtype, ...],
        rank: int,
        finite: bool = False,
        copy: bool = True,
    ) -> torch.Tensor:
        """Decode one request tensor; a malformed one is INVALID_ARGUMENT naming the field.
        ``copy=False``: a read-only view of the request's bytes."""
        max_bytes = self.cfg.max_message_bytes
        return wire(
            lambda: from_proto(
                msg, name, dtypes=dtypes, rank=rank, finite=finite, max_bytes=max_bytes, copy=copy
            )
        )

    def rows(self, corpus_id: str, rows: torch.Tensor) -> None:
        """OUT_OF_RANGE unless every row ≥ 0 is a valid row of a frame of ``corpus_id``."""
        try:
            self.pool.check_rows(corpus_id, rows)
        except RowError as e:
            raise Reject(S.OUT_OF_RANGE, str(e)) from None

    def attend(self, request: holder_pb2.AttendRequest, on_device: bool) -> AttendCall:
        """``on_device``: leave q's values and the rows to the device check (a GPU holder reads
        the payload in place and only copies it to the device); else check them here."""
        geo, cfg = self.pool.geo, self.cfg
        self.held(request.corpus_id)
        self.layer(request.layer)
        q = self.tensor(request.q, "q", FLOATS, 3, finite=not on_device, copy=not on_device)
        rows = self.tensor(request.rows, "rows", INTS, 2, copy=not on_device)
        n, h, d = q.shape
        if d != geo.kv_dim or not 0 < h <= MAX_HEADS or n > cfg.max_rows:
            raise Reject(
                S.INVALID_ARGUMENT,
                f"q must be [n ≤ {cfg.max_rows}, 1 ≤ h ≤ {MAX_HEADS}, {geo.kv_dim}], "
                f"got {list(q.shape)}",
            )
        if rows.shape[0] != n or rows.shape[1] > cfg.max_k:
            raise Reject(
                S.INVALID_ARGUMENT,
                f"rows must be [{n}, k ≤ {cfg.max_k}], got {list(rows.shape)}",
            )
        if not (request.scale > 0 and request.scale < float("inf")):
            raise Reject(S.INVALID_ARGUMENT, f"scale must be finite and > 0, got {request.scale}")
        if not on_device:
            self.rows(request.corpus_id, rows)
        return AttendCall(request.corpus_id, request.layer, q, rows, request.scale)

    def device_found(self, call: AttendCall, bad: torch.Tensor) -> None:
        """Raise the Reject for what the device check found: ``bad [2]`` = (q not finite,
        rows not the corpus's); nothing when both are False."""
        if bool(bad[0]):
            raise Reject(S.INVALID_ARGUMENT, "q: contains NaN or infinite values")
        if bool(bad[1]):
            self.rows(call.corpus_id, call.rows)  # raises with the first bad row named
            raise AssertionError("the device found bad rows that check_rows accepts")

    def index_topk(self, request: holder_pb2.IndexTopKRequest) -> TopKCall:
        geo, cfg = self.pool.geo, self.cfg
        self.held(request.corpus_id)
        self.layer(request.layer)
        q = self.tensor(request.q, "q", FLOATS, 3, finite=True)
        w = self.tensor(request.weights, "weights", FLOATS, 2, finite=True)
        limit = self.tensor(request.limit, "limit", INTS, 1)
        n = q.shape[0]
        if (
            q.shape[2] != geo.index_dim
            or n > cfg.max_rows
            or tuple(w.shape) != tuple(q.shape[:2])
            or tuple(limit.shape) != (n,)
            or not 0 < request.k <= cfg.max_k
            or request.arith not in ("", *ARITHS)
        ):
            raise Reject(
                S.INVALID_ARGUMENT,
                f"need q [n, H_I, {geo.index_dim}], weights [n, H_I], limit [n], 0 < k ≤ "
                f"{cfg.max_k}, arith in {ARITHS}; got q {list(q.shape)}, weights {list(w.shape)}, "
                f"limit {list(limit.shape)}, k {request.k}, arith {request.arith!r}",
            )
        arith = request.arith or "exact"
        if arith == "fp8" and geo.index_dim % 128:  # fp8 keys are quantized in 128-wide blocks
            raise Reject(
                S.INVALID_ARGUMENT,
                f"arith 'fp8' needs index keys a multiple of 128 wide; this model's are "
                f"{geo.index_dim} (use arith 'exact')",
            )
        return TopKCall(request.corpus_id, request.layer, q, w, limit, int(request.k), arith)

    def fetch(self, request: holder_pb2.FetchRequest) -> tuple[list[int], list[int]]:
        """(layers, frames of the requested pages); all layers when none are named.
        RESOURCE_EXHAUSTED when the reply would exceed the message limit."""
        geo = self.pool.geo
        self.held(request.corpus_id)
        layers = list(request.layers) or list(range(geo.n_layers))
        for layer in layers:
            self.layer(layer)
        frames = self.frames_of(request.corpus_id, list(request.pages))
        width = geo.kv_dim + (geo.index_dim if request.index_keys else 0)
        elt = torch.empty((), dtype=geo.dtype).element_size()
        nbytes = len(frames) * len(layers) * geo.page_size * width * elt
        if nbytes > self.cfg.max_message_bytes:
            raise Reject(
                S.RESOURCE_EXHAUSTED,
                f"fetch of {len(frames):,} pages × {len(layers)} layers is {nbytes:,} bytes, past "
                f"this holder's message limit of {self.cfg.max_message_bytes:,}; fetch fewer "
                "pages per call",
            )
        return layers, frames

    def frames_of(self, corpus_id: str, pages: list[int]) -> list[int]:
        """The frames holding ``pages`` of a held corpus: OUT_OF_RANGE past its last page,
        NOT_FOUND for pages it has that another holder holds."""
        held = self.held(corpus_id)
        bad = [p for p in pages if p not in held.pages]
        if bad:
            code = S.OUT_OF_RANGE if max(bad) >= held.n_pages else S.NOT_FOUND
            raise Reject(
                code,
                f"pages {bad[:4]} of corpus {corpus_id} are not held here "
                f"(it has pages 0..{held.n_pages - 1}; held: {len(held.pages)})",
            )
        return [held.pages[p] for p in pages]
