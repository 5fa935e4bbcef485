"""The coordinator's calls to holders: Assign, Release, Info (wire types stop here).

One channel per holder address, kept open; a channel that failed to reach its holder is dropped
so the next call dials afresh instead of waiting out gRPC's reconnect backoff (a restarted
holder comes back on the same address).
"""

from __future__ import annotations

import grpc

from corpusd import security
from corpusd.v1 import holder_pb2, holder_pb2_grpc

#: Codes meaning "the holder was not reached or did not answer in time".
UNREACHABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class HolderCallError(Exception):
    """A holder refused or did not answer; ``code`` is its status, ``holder_id`` who."""

    def __init__(self, holder_id: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"holder {holder_id}: {code.name}: {message}")
        self.holder_id, self.code, self.detail = holder_id, code, message

    @property
    def unreachable(self) -> bool:
        return self.code in UNREACHABLE


class Links:
    """Holder stubs by address, with the coordinator's per-call deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> holder_pb2_grpc.HolderStub:
        if address not in self._channels:
            self._channels[address] = security.channel(address)
        return holder_pb2_grpc.HolderStub(self._channels[address])

    async def _drop(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def assign(
        self, holder_id: str, address: str, corpus_id: str, pages: list[int]
    ) -> dict[int, int]:
        """Load ``pages`` (non-empty) of a corpus on a holder; returns page → frame.
        Raises HolderCallError."""
        assert pages, "an empty page list would mean every page"
        try:
            r = await self._stub(address).Assign(
                holder_pb2.AssignRequest(corpus_id=corpus_id, pages=pages), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise await self._error(holder_id, address, e) from None
        return {pf.page: pf.frame for pf in r.frames}

    async def release(self, holder_id: str, address: str, corpus_id: str, pages: list[int]) -> int:
        """Free ``pages`` (non-empty) of a corpus on a holder; a holder that does not hold it
        counts as done (0 freed). Raises HolderCallError."""
        assert pages, "an empty page list would mean every page"
        try:
            r = await self._stub(address).Release(
                holder_pb2.ReleaseRequest(corpus_id=corpus_id, pages=pages),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise await self._error(holder_id, address, e) from None
        return int(r.freed)

    async def held(self, holder_id: str, address: str) -> dict[str, dict[int, int]]:
        """What the holder has: corpus → {page: frame}. Raises HolderCallError."""
        try:
            r = await self._stub(address).Info(holder_pb2.InfoRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise await self._error(holder_id, address, e) from None
        return {c.corpus_id: {pf.page: pf.frame for pf in c.frames} for c in r.corpora}

    async def _error(
        self, holder_id: str, address: str, e: grpc.aio.AioRpcError
    ) -> HolderCallError:
        if e.code() in UNREACHABLE:
            await self._drop(address)
        return HolderCallError(holder_id, e.code(), e.details() or "")

    async def close(self) -> None:
        for address in list(self._channels):
            await self._drop(address)
