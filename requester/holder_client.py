"""An asyncio client of one holder: tensors in, tensors out (wire types stop here)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from corpusd import security
from corpusd.transport import cuda_ipc
from corpusd.transport.cuda_ipc import SharedTensor
from corpusd.v1 import holder_pb2, holder_pb2_grpc
from corpusd.wire import from_proto, to_proto

_ANY = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)


def _t(msg: object, field: str, rank: int) -> torch.Tensor:
    return from_proto(msg, field, dtypes=_ANY, rank=rank)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Partial:
    o: torch.Tensor  # [n, h, d_v]
    lse: torch.Tensor  # [n, h] float32, natural log
    kernel: str
    compute_us: float


class HolderClient:
    """A holder's gRPC stub with tensors in and out; also the gRPC route (``name``)."""

    name = "grpc"

    def __init__(self, address: str, max_message_bytes: int = 256 << 20) -> None:
        opts = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.address = address
        self.channel = security.channel(address, opts)
        self.stub = holder_pb2_grpc.HolderStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def alive(self, timeout: float) -> bool:
        """Whether the holder's health service answers within ``timeout`` seconds (SERVING or
        not: a draining holder is alive). A stopped process, or a cut link, does not."""
        try:
            await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return True

    async def attend_rows(
        self,
        corpus_id: str,
        layer: int,
        q: torch.Tensor,
        rows: torch.Tensor,
        scale: float,
        timeout: float | None = None,
    ) -> Partial:
        """Partial attention of ``q [n, h, kv_dim]`` over pool ``rows [n, k]`` (int32 as the
        fan-out makes them; -1 = unused) on this holder."""
        r = await self.stub.Attend(
            holder_pb2.AttendRequest(
                corpus_id=corpus_id,
                layer=layer,
                q=to_proto(q),
                rows=to_proto(rows.to(torch.int32)),  # a no-op for the fan-out's rows
                scale=scale,
            ),
            timeout=timeout,
        )
        return Partial(_t(r.o, "o", 3), _t(r.lse, "lse", 2), r.kernel, r.compute_us)

    async def fetch(
        self,
        corpus_id: str,
        pages: list[int],
        layers: list[int] | None = None,
        index_keys: bool = False,
        timeout: float | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        r = await self.stub.Fetch(
            holder_pb2.FetchRequest(
                corpus_id=corpus_id, pages=pages, layers=layers or [], index_keys=index_keys
            ),
            timeout=timeout,
        )
        return [_t(t, "latent", 3) for t in r.latent], [
            _t(t, "index_keys", 3) for t in r.index_keys
        ]

    async def index_topk(
        self,
        corpus_id: str,
        layer: int,
        q: torch.Tensor,
        weights: torch.Tensor,
        limit: torch.Tensor,
        k: int,
        arith: str = "exact",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = await self.stub.IndexTopK(
            holder_pb2.IndexTopKRequest(
                corpus_id=corpus_id,
                layer=layer,
                q=to_proto(q),
                weights=to_proto(weights),
                limit=to_proto(limit.to(torch.int64)),
                k=k,
                arith=arith,
            )
        )
        return _t(r.positions, "positions", 2), _t(r.scores, "scores", 2)

    async def index_keys(self, corpus_id: str, layer: int) -> dict[int, torch.Tensor]:
        """page → ``[page_size, index_dim]`` for every page this holder has of the corpus."""
        out: dict[int, torch.Tensor] = {}
        async for chunk in self.stub.IndexKeys(
            holder_pb2.IndexKeysRequest(corpus_id=corpus_id, layer=layer)
        ):
            keys = _t(chunk.keys, "keys", 3)
            out.update({int(p): keys[i] for i, p in enumerate(chunk.pages)})
        return out

    async def assign(self, corpus_id: str, pages: list[int] | None = None) -> dict[int, int]:
        r = await self.stub.Assign(holder_pb2.AssignRequest(corpus_id=corpus_id, pages=pages or []))
        return {pf.page: pf.frame for pf in r.frames}

    async def release(self, corpus_id: str, pages: list[int] | None = None) -> int:
        r = await self.stub.Release(
            holder_pb2.ReleaseRequest(corpus_id=corpus_id, pages=pages or [])
        )
        return int(r.freed)

    async def info(self, timeout: float | None = None) -> holder_pb2.InfoResponse:
        return await self.stub.Info(holder_pb2.InfoRequest(), timeout=timeout)

    async def share_pool(
        self, device_uuid: str, peer: bool = False
    ) -> tuple[list[SharedTensor], int, int, str]:
        """The holder's per-layer latent pools as CUDA IPC handles, with its page size, value
        width and incarnation (a random id of the holder process: another after a restart), for
        a requester on GPU ``device_uuid``; ``peer``: or on another GPU of the host, which maps
        them over NVLink peer access (each handle names the holder's GPU). Raises
        grpc.aio.AioRpcError (FAILED_PRECONDITION) when the holder is on the CPU, or on another
        GPU without ``peer``."""
        r = await self.stub.SharePool(
            holder_pb2.SharePoolRequest(device_uuid=device_uuid, peer=peer)
        )
        shared = [cuda_ipc.from_wire(t) for t in r.latent]
        return shared, int(r.page_size), int(r.d_v), r.incarnation
