"""Route transports on CPU, with the NVSHMEM pieces faked: which transport ``connect`` picks
(the registry's rules, one job per process), what the NVSHMEM route returns (rows split over
ring slots, Attend's dtypes) and how it fails (Attend's statuses, broken → gRPC), and the holder
endpoint's Join (probe takes no slot; members are fixed once the job is up). The real thing runs
on two GPUs in ``tests/test_gpu_transport.py``."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from corpusd.kernels.reference import partial_attention
from corpusd.rpc import StatusError
from corpusd.testing.numeric import rel
from corpusd.transport import nvshmem_ring as nr
from corpusd.v1 import transport_pb2
from requester import routes
from requester.holder_client import Partial
from requester.nvshmem_client import NvshmemClient, RemoteRowError

D, D_V, POOL = 576, 512, 300
SCALE = D**-0.5


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass
class FakePending:
    views: tuple[torch.Tensor, ...]
    bad: bool
    finished: bool = True

    @property
    def done(self) -> Any:
        return SimpleNamespace(query=lambda: self.finished)

    def check(self) -> None:
        if self.bad:
            raise RemoteRowError("attend seq 1: holder rejected rows (status 1)")


@dataclass
class FakeNvshmem:
    """The holder's NVSHMEM side in-process: the torch reference on a bf16 pool, rows past
    ``owned`` rejected by the status word, as the endpoint's device check does."""

    ring: nr.RingGeometry
    pool: torch.Tensor
    owned: int
    job: Any = field(default_factory=lambda: SimpleNamespace(device=torch.device("cpu")))
    opened: list[tuple[int, int, int]] = field(default_factory=list)
    fail_open: grpc.aio.AioRpcError | None = None
    hang: bool = False

    async def open_stream(self, mode: str, count: int, rows: int, heads: int, topk: int,
                          *rest: Any) -> int:  # fmt: skip
        if self.fail_open is not None:
            raise self.fail_open
        assert mode == "attend" and count == 1
        assert nr.attend_request_bytes(rows, heads, topk) <= self.ring.req_bytes
        self.opened.append((rows, heads, topk))
        return len(self.opened)

    def attend(self, q: torch.Tensor, idx: torch.Tensor) -> FakePending:
        assert q.dtype == torch.bfloat16 and idx.dtype == torch.int32
        o, lse = partial_attention(q, self.pool, idx.long().clamp(max=POOL - 1), SCALE, D_V)
        return FakePending((o, lse), bool((idx >= self.owned).any()), not self.hang)

    async def close(self, leave: bool = True) -> bool:
        return True


class FakeGrpc:
    name = "grpc"

    def __init__(self) -> None:
        self.calls = 0

    async def attend_rows(self, *args: Any, **kwargs: Any) -> Partial:
        self.calls += 1
        q = args[2]
        return Partial(torch.zeros(q.shape[0], q.shape[1], D_V), torch.zeros(q.shape[:2]), "", 0)


def small_route(owned: int = POOL) -> tuple[routes.NvshmemRoute, FakeNvshmem, FakeGrpc]:
    ring = nr.RingGeometry.for_shapes(peers=1, depth=2, rows=4, heads=8, topk=16, fetch_rows=1)
    pool = torch.randn(POOL, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    fake, plain = FakeNvshmem(ring, pool, owned), FakeGrpc()
    return routes.NvshmemRoute(fake, plain, "holder:1"), fake, plain  # type: ignore[arg-type]


def test_nvshmem_route_splits_rows_over_slots_and_answers_like_attend() -> None:
    route, fake, plain = small_route()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(10, 8, D, generator=g)
    rows = torch.randint(0, POOL, (10, 16), generator=g)
    rows[3, 5:] = -1
    part = asyncio.run(route.attend_rows("c", 0, q, rows, SCALE))
    assert [r for r, _, _ in fake.opened] == [4, 4, 2], "one slot holds 4 rows of 8 heads × 16"
    ref_o, ref_lse = partial_attention(q.bfloat16(), fake.pool, rows, SCALE, D_V)
    assert part.o.dtype == q.dtype and part.lse.dtype == torch.float32  # Attend's dtypes
    # The fake attends slot by slot (4, 4, 2 rows) and the reference all 10 rows at once: bmms
    # of different shapes may sum in another order: LSE to fp32 rounding, O (bf16 here) to
    # within one bf16 step.
    assert rel(part.o, ref_o.to(q.dtype)) <= 4e-3 and rel(part.lse, ref_lse) <= 1e-6
    assert plain.calls == 0 and not route.broken


def test_nvshmem_route_fails_like_attend_and_falls_back_when_broken() -> None:
    route, fake, plain = small_route(owned=100)
    q, rows = torch.randn(2, 8, D), torch.full((2, 16), 5)
    rows[1, 3] = 200  # not the corpus's
    with pytest.raises(StatusError) as e:
        asyncio.run(route.attend_rows("c", 0, q, rows, SCALE))
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE and not route.broken
    fake.fail_open = rpc_error(grpc.StatusCode.NOT_FOUND, "corpus 'x' is not held")
    with pytest.raises(StatusError) as e:
        asyncio.run(route.attend_rows("x", 0, q, rows, SCALE))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and not route.broken
    fake.fail_open = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    with pytest.raises(StatusError) as e:
        asyncio.run(route.attend_rows("c", 0, q, rows, SCALE))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and route.broken
    asyncio.run(route.attend_rows("c", 0, q, rows, SCALE))
    assert plain.calls == 1, "a broken NVSHMEM route sends over gRPC"


def test_nvshmem_route_times_out_and_breaks() -> None:
    route, fake, _ = small_route()
    fake.hang = True
    q, rows = torch.randn(1, 8, D), torch.zeros(1, 16, dtype=torch.int64)
    with pytest.raises(StatusError) as e:
        asyncio.run(route.attend_rows("c", 0, q, rows, SCALE, timeout=0.05))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and route.broken


def test_requests_larger_than_a_slot_go_over_grpc() -> None:
    route, fake, plain = small_route()
    q, rows = torch.randn(1, 8, D), torch.zeros(1, 1 << 16, dtype=torch.int64)
    asyncio.run(route.attend_rows("c", 0, q, rows, SCALE))
    assert plain.calls == 1 and not fake.opened


# -- connect: the registry's choice ----------------------------------------------------------------


@pytest.fixture
def nvshmem_here(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Pretend this process can run NVSHMEM; probe and join answer from ``state``."""
    state: dict[str, Any] = {"host": socket.gethostname(), "joined": 0, "probe_error": None}
    monkeypatch.setattr(nr, "available", lambda: True)
    monkeypatch.setattr(routes, "_JOINED", {})
    monkeypatch.delenv("NVSHMEM_IB_ENABLE_IBGDA", raising=False)

    async def probe(channel: Any, timeout: float | None = None) -> Any:
        if state["probe_error"] is not None:
            raise state["probe_error"]
        return SimpleNamespace(job_id=f"{state['host']}:1:h", host=state["host"])

    async def join(address: str, requester_id: str, device: int) -> Any:
        state["joined"] += 1
        return SimpleNamespace(job_id=f"{state['host']}:1:h", rank=1, ring=None)

    monkeypatch.setattr(NvshmemClient, "probe", staticmethod(probe))
    monkeypatch.setattr(NvshmemClient, "join", staticmethod(join))
    return state


def connect(transport: str, address: str = "h:1") -> routes.Route:
    holder = SimpleNamespace(channel=None, name="grpc")  # a HolderClient is the gRPC route
    return asyncio.run(routes.connect(address, holder, transport, 0, "r"))  # type: ignore[arg-type]


def test_connect_picks_nvshmem_on_one_node_and_only_one_job_per_process(
    nvshmem_here: dict[str, Any],
) -> None:
    assert connect("grpc").name == "grpc" and nvshmem_here["joined"] == 0
    assert connect("auto", "h:1").name == "nvshmem" and nvshmem_here["joined"] == 1
    # a second holder's job: NVSHMEM initialises once per process
    assert connect("auto", "h:2").name == "grpc"
    with pytest.raises(ValueError, match="already in NVSHMEM job"):
        connect("nvshmem", "h:3")


def test_connect_keeps_grpc_across_nodes_without_ibgda_or_without_an_offer(
    nvshmem_here: dict[str, Any],
) -> None:
    nvshmem_here["host"] = "another-node"
    assert connect("auto").name == "grpc" and nvshmem_here["joined"] == 0
    with pytest.raises(ValueError, match="not usable"):
        connect("nvshmem")
    nvshmem_here["probe_error"] = rpc_error(grpc.StatusCode.UNIMPLEMENTED, "no Transport")
    assert connect("auto").name == "grpc"
    with pytest.raises(ValueError, match="offers no NVSHMEM job"):
        connect("nvshmem")


# -- the holder's Join -----------------------------------------------------------------------------


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Ctx:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def test_join_probe_takes_no_slot_and_members_are_fixed_once_the_job_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from holder import nvshmem_endpoint as ep

    monkeypatch.setattr(nr, "new_uid", lambda: b"u" * nr.UID_BYTES)
    started: list[int] = []
    monkeypatch.setattr(ep.NvshmemEndpoint, "_init", lambda self: started.append(1))
    pool = SimpleNamespace(geo=SimpleNamespace(device="cuda:0"))
    ring = nr.RingGeometry.for_shapes(2, 2, 4, 8, 16, 1)
    e = ep.NvshmemEndpoint(pool, None, ring, "node:7:h", "node")  # type: ignore[arg-type]

    def join(rid: str, probe: bool = False) -> Any:
        req = transport_pb2.JoinRequest(requester_id=rid, host="node", probe=probe)
        return asyncio.run(e.Join(req, Ctx()))

    p = join("", probe=True)
    assert (p.rank, p.uid, p.job_id, p.host) == (0, b"", "node:7:h", "node")
    a = join("a")
    assert a.rank == 1 and a.uid == b"u" * nr.UID_BYTES and not started
    assert join("a").rank == 1, "asking again before init keeps the rank"
    assert join("b").rank == 2
    e._init_thread.join()  # type: ignore[union-attr]
    assert started == [1], "init starts once every slot is taken"
    with pytest.raises(Aborted) as err:
        join("c")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(Aborted) as err:
        join("a")  # a restarted requester cannot re-enter a job that is up
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert join("", probe=True).rank == 0, "probes are answered whatever the job's state"
    e.close()


def test_a_deferred_reply_must_be_waited_for_before_the_next_graphed_call() -> None:
    """``GraphedAttend(wait=False)``: the next call resets the reply signal, so a call whose
    reply no stream waited for would lose it; the next call refuses, before it touches the
    GPU, until ``wait_on`` (or ``result``) was called."""
    from requester.nvshmem_client import DeferredPending, GraphedAttend

    ga = object.__new__(GraphedAttend)  # the refusal comes before any CUDA call
    ga.wait = False
    t = torch.zeros(1)
    ga.last = DeferredPending(None, None, t, (t,), t, t, "attend seq 7")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="attend seq 7: its reply was never waited for"):
        ga()
    ga.last.awaited = True  # as wait_on leaves it
    with pytest.raises(AttributeError):  # past the check: this stand-in has no client
        ga()


@pytest.mark.parametrize("heads", [16, 64, 128, 160, 1024])
def test_a_holders_ring_takes_its_rows_of_the_models_heads(heads: int) -> None:
    """The ring's slots hold ``--nvshmem-rows`` query rows of the model's own heads. They were
    sized for 128 heads whatever the model: at ``--nvshmem-rows 1`` a 160-head model's row did
    not fit, and every attend went over gRPC."""
    from holder.config import HolderConfig
    from holder.nvshmem_endpoint import ring_geometry

    cfg = HolderConfig(store="unused", state_dir="unused", device="cuda:0", dtype="bfloat16",
                       nvshmem_peers=1, nvshmem_rows=1, nvshmem_topk=2048)  # fmt: skip
    ring = ring_geometry(cfg, heads)
    route = SimpleNamespace(client=SimpleNamespace(ring=ring))
    assert routes.NvshmemRoute._rows_per_request(route, heads, 2048) >= 1  # type: ignore[arg-type]
    assert ring.req_bytes >= ring_geometry(cfg, 64).req_bytes  # never under the 128-head size
