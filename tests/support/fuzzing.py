"""Fuzzing corpusd's three gRPC services with requests drawn around valid ones.

Each request starts from a valid request of one RPC (``TARGETS``: every RPC of Holder,
Coordinator and Agent) and is then, at random (seeded), left as it is or mutated: fields set to
edge values of their type (0, 2³²−1, NaN, ±inf, empty, 1 MB strings, unknown ids, 100k-element
lists), tensor fields given wrong dtypes, negative, huge or mismatched shapes, random or
non-finite bytes, or the serialised message truncated, bit-flipped or replaced by random
bytes. Requests go out as raw bytes (so a message that does not parse is sent as it is), several
at once, and every answer's status code is counted per RPC. ``BAD`` codes are failures: a
daemon must answer every request with a precise status and keep serving.

Used by ``tests/procs/test_fuzz.py`` (a CI-sized run) and ``tools/fuzz.py`` (≥ 10,000).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import struct
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig, fingerprint
from corpusd.v1 import agent_pb2, agent_pb2_grpc, coordinator_pb2, holder_pb2, tensor_pb2
from holder.launch import HolderProcess
from requester.launch import AgentProcess, start_agent
from tests.support.coordinators import start_holders, synthetic_corpus
from tests.support.holders import pin_sample

S = grpc.StatusCode
#: answers that are failures whatever the request: an unexpected exception (INTERNAL, UNKNOWN),
#: a request that hung (DEADLINE_EXCEEDED: the fuzzer's deadline is generous), a daemon gone
BAD = frozenset({S.INTERNAL, S.UNKNOWN, S.DEADLINE_EXCEEDED, S.UNAVAILABLE, S.DATA_LOSS})
#: UNAVAILABLE is a precise answer here: a pin placed on a holder that the fuzzer registered
#: with an address nobody serves ("was not published (nothing kept)")
ALSO_FINE = {
    ("coordinator", "Pin"): frozenset({S.UNAVAILABLE}),
    ("coordinator", "ChooseWorker"): frozenset({S.UNAVAILABLE}),  # "no live agent worker"
}
SERVICES = {"holder": "Holder", "coordinator": "Coordinator", "agent": "Agent"}
DEADLINE_S = 60.0


@dataclass
class Ctx:
    """What valid requests need: the corpus (and a victim corpus the fuzzer may assign, release,
    pin and unpin), model widths, holders with their frames, and sessions opened so far."""

    corpus_id: str
    corpus_name: str
    victim_id: str
    victim_name: str
    tokens: int
    n_pages: int
    page_size: int
    n_layers: int
    heads: int
    kv_dim: int
    index_heads: int
    index_dim: int
    vocab: int
    fingerprint: str
    holders: dict[str, dict[int, int]]  # holder address → page → frame of the corpus
    holder_ids: list[str]
    sessions: list[str] = field(default_factory=list)

    def names_corpus(self, text: str) -> bool:
        """Whether ``text`` names the corpus under test (by id, name or an id prefix ≥ 8)."""
        return _names(text, self.corpus_id, self.corpus_name)

    def names_victim(self, text: str) -> bool:
        return _names(text, self.victim_id, self.victim_name)

    def strings(self) -> list[str]:
        """Strings worth trying in any string field: known ids, near misses, junk."""
        return [
            "",
            self.corpus_id,
            self.corpus_id[:8],
            self.corpus_id[:7],
            self.corpus_id.upper(),
            self.corpus_name,
            self.victim_id,
            self.victim_name,
            "0" * 32,
            "../../etc/passwd",
            "a\x00b",
            "é漢字🙂",
            " ",
            "x" * 5000,
            *self.holder_ids,
            *self.sessions[-3:],
            "127.0.0.1:1",
            "exact",
            "fp8",
            "float32",
        ]


def _names(text: str, corpus_id: str, name: str) -> bool:
    return text in (corpus_id, name) or (len(text) >= 8 and corpus_id.startswith(text))


# -- valid requests, one builder per RPC -----------------------------------------------------------
def _t(x: torch.Tensor) -> tensor_pb2.Tensor:
    x = x.contiguous()
    return tensor_pb2.Tensor(
        dtype=str(x.dtype).removeprefix("torch."),
        shape=list(x.shape),
        data=x.view(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b"",
    )


def _rows(ctx: Ctx, addr: str, rng: random.Random, n: int, k: int) -> torch.Tensor:
    """Valid pool rows of the corpus on ``addr``: ``[n, k]`` int32, some -1."""
    frames = ctx.holders[addr]
    rows = []
    for page, frame in frames.items():
        valid = min(ctx.page_size, ctx.tokens - page * ctx.page_size)
        rows += [frame * ctx.page_size + s for s in range(valid)]
    out = [[rng.choice(rows) if rng.random() < 0.9 else -1 for _ in range(k)] for _ in range(n)]
    return torch.tensor(out, dtype=torch.int32)


def _holder_requests(ctx: Ctx, addr: str, rng: random.Random) -> dict[str, Message]:
    n, h, k = rng.randint(1, 4), rng.choice([1, 2, 16, ctx.heads]), rng.choice([1, 8, 64])
    layer = rng.randrange(ctx.n_layers)
    held = sorted(ctx.holders[addr])
    return {
        "Attend": holder_pb2.AttendRequest(
            corpus_id=ctx.corpus_id,
            layer=layer,
            q=_t(torch.randn(n, h, ctx.kv_dim)),
            rows=_t(_rows(ctx, addr, rng, n, k)),
            scale=ctx.kv_dim**-0.5,
        ),
        "Fetch": holder_pb2.FetchRequest(
            corpus_id=ctx.corpus_id,
            layers=[layer],
            pages=rng.sample(held, min(len(held), 2)),
            index_keys=rng.random() < 0.5,
        ),
        "IndexTopK": holder_pb2.IndexTopKRequest(
            corpus_id=ctx.corpus_id,
            layer=layer,
            q=_t(torch.randn(n, ctx.index_heads, ctx.index_dim)),
            weights=_t(torch.randn(n, ctx.index_heads)),
            limit=_t(torch.full((n,), ctx.tokens, dtype=torch.int64)),
            k=rng.choice([1, 16, 128]),
            arith=rng.choice(["", "exact", "fp8"]),
        ),
        "IndexKeys": holder_pb2.IndexKeysRequest(corpus_id=ctx.corpus_id, layer=layer),
        "Assign": holder_pb2.AssignRequest(corpus_id=ctx.victim_id, pages=[rng.randrange(3)]),
        "Release": holder_pb2.ReleaseRequest(corpus_id=ctx.victim_id, pages=[rng.randrange(3)]),
        "Info": holder_pb2.InfoRequest(),
        "SharePool": holder_pb2.SharePoolRequest(device_uuid="GPU-" + "0" * 8),
    }


def _coordinator_requests(ctx: Ctx, rng: random.Random) -> dict[str, Message]:
    cpb = coordinator_pb2
    fake = f"fuzz-{rng.randrange(1000)}"
    return {
        "RegisterHolder": cpb.RegisterHolderRequest(
            holder=cpb.HolderAddress(
                holder_id=fake,
                address=f"127.0.0.1:{rng.randrange(1, 20)}",
                device="cpu",
                capacity_frames=rng.randint(1, 64),
                page_size=ctx.page_size,
                model_fingerprint="fuzz:" + fake,  # never placed on: another model
                dtype="float32",
            )
        ),
        "Heartbeat": cpb.HeartbeatRequest(holder_id=fake, used_frames=1, active_flows=0),
        "ListCorpora": cpb.ListCorporaRequest(),
        "GetPageTable": cpb.GetPageTableRequest(corpus_id=ctx.corpus_id),
        "Pin": cpb.PinRequest(corpus_id=ctx.victim_id, replicas=1),
        "Unpin": cpb.UnpinRequest(corpus_id=ctx.victim_id),
        "Delete": cpb.DeleteRequest(corpus_id=ctx.corpus_id),  # pinned: refused
        "ListHolders": cpb.ListHoldersRequest(),
        "ReportWorker": cpb.WorkerReport(
            worker_id=fake,
            address="127.0.0.1:1",
            max_batch=4,
            kv_capacity=1000,
            corpora=[ctx.corpus_id],
        ),
        "ListWorkers": cpb.ListWorkersRequest(),
        "ChooseWorker": cpb.ChooseWorkerRequest(session_tokens=rng.randint(1, 100)),
    }


def _agent_requests(ctx: Ctx, rng: random.Random) -> dict[str, Message]:
    apb = agent_pb2
    session = rng.choice(ctx.sessions) if ctx.sessions else "s-none"
    n, k = rng.randint(1, 3), rng.choice([1, 16, 128])
    positions = torch.randint(-1, ctx.tokens, (n, k))
    by_index = rng.random() < 0.3
    prompt = [rng.randrange(ctx.vocab) for _ in range(rng.randint(1, 8))]
    return {
        "OpenSession": apb.OpenSessionRequest(
            corpus=rng.choice([ctx.corpus_name, ctx.corpus_id, ctx.corpus_id[:8]]),
            **(
                {"tokens": apb.TokenList(ids=prompt)}
                if rng.random() < 0.5
                else {"text": "what is on line 3?"}
            ),
        ),
        "Generate": apb.GenerateRequest(
            session_id=session,
            params=apb.SamplingParams(max_tokens=rng.randint(1, 2), temperature=0.0),
        ),
        "CloseSession": apb.CloseSessionRequest(session_id=session),
        "Attend": apb.AgentAttendRequest(
            corpus=ctx.corpus_id,
            layer=rng.randrange(ctx.n_layers),
            q=_t(torch.randn(n, ctx.heads, ctx.kv_dim)),
            **(
                {
                    "index_q": _t(torch.randn(n, ctx.index_heads, ctx.index_dim)),
                    "index_weights": _t(torch.randn(n, ctx.index_heads)),
                }
                if by_index
                else {"positions": _t(positions)}
            ),
            scale=0.0,
        ),
    }


@dataclass(frozen=True, slots=True)
class Target:
    service: str  # holder, coordinator, agent
    method: str
    streaming: bool

    @property
    def path(self) -> str:
        return f"/corpusd.v1.{SERVICES[self.service]}/{self.method}"

    @property
    def name(self) -> str:
        return f"{self.service}.{self.method}"


TARGETS = [
    *(
        Target("holder", m, m == "IndexKeys")
        for m in (
            "Attend",
            "Fetch",
            "IndexTopK",
            "IndexKeys",
            "Assign",
            "Release",
            "Info",
            "SharePool",
        )
    ),
    *(
        Target("coordinator", m, False)
        for m in (
            "RegisterHolder",
            "Heartbeat",
            "ListCorpora",
            "GetPageTable",
            "Pin",
            "Unpin",
            "Delete",
            "ListHolders",
            "ReportWorker",
            "ListWorkers",
            "ChooseWorker",
        )
    ),
    *(
        Target("agent", m, m == "Generate")
        for m in ("OpenSession", "Generate", "CloseSession", "Attend")
    ),
]


# -- mutations ---------------------------------------------------------------------------------
_U32 = [0, 1, 2, 3, 7, 63, 64, 65, 127, 128, 129, 255, 1023, 4096, 2**16, 2**31 - 1, 2**31]
_U32 += [2**32 - 1]
_U64 = [*_U32, 2**40, 2**53 + 1, 2**63, 2**64 - 1]
_I64 = [*_U32, -1, -2, -(2**31), -(2**63), 2**62, 2**63 - 1]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-3, 3.4e38, -3.4e38, math.nan, math.inf, -math.inf]
_IDS = frozenset({"corpus_id", "corpus", "session_id"})
_DTYPES = ["float32", "bfloat16", "float16", "int32", "int64", "", "float64", "uint8", "?" * 40]


class Mutator:
    def __init__(self, rng: random.Random, ctx: Ctx) -> None:
        self.rng, self.ctx = rng, ctx

    def scalar(self, f: FD) -> Any:
        r = self.rng
        t = f.type
        if t == FD.TYPE_STRING:
            return r.choice(self.ctx.strings()) if r.random() < 0.8 else _junk_str(r)
        if t == FD.TYPE_BYTES:
            return r.randbytes(r.choice([0, 1, 16, 64, 1000]))
        if t == FD.TYPE_BOOL:
            return r.random() < 0.5
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return r.choice(_FLOATS) if r.random() < 0.8 else r.uniform(-1e6, 1e6)
        if t == FD.TYPE_UINT32:
            return r.choice(_U32) if r.random() < 0.8 else r.randrange(2**32)
        if t == FD.TYPE_UINT64:
            return r.choice(_U64) if r.random() < 0.8 else r.randrange(2**64)
        if t in (FD.TYPE_INT64, FD.TYPE_INT32):
            lo, hi = (-(2**63), 2**63) if t == FD.TYPE_INT64 else (-(2**31), 2**31)
            return r.choice([v for v in _I64 if lo <= v < hi]) if r.random() < 0.8 else 0
        raise AssertionError(f"no values for field {f.full_name} of type {t}")

    def fields(self, msg: Message, depth: int = 0) -> None:
        """Set 1–3 fields of ``msg`` (or of its sub-messages) to values drawn for their type."""
        r = self.rng
        fs = list(msg.DESCRIPTOR.fields)
        if r.random() < 0.8:  # mostly keep the ids, so checks past the first one are reached
            fs = [f for f in fs if f.name not in _IDS] or fs
        for f in r.sample(fs, min(len(fs), r.randint(1, 3))) if fs else ():
            if f.type == FD.TYPE_MESSAGE:
                sub = getattr(msg, f.name)
                if f.message_type.full_name == "corpusd.v1.Tensor" and not _repeated(f):
                    self.tensor(sub)
                elif _repeated(f):
                    if r.random() < 0.5:
                        del sub[:]
                    else:
                        for _ in range(r.choice([1, 2, 50])):
                            self.fields(sub.add(), depth + 1)
                elif depth < 3:
                    if r.random() < 0.2:
                        msg.ClearField(f.name)
                    else:
                        self.fields(sub, depth + 1)
            elif _repeated(f):
                n = r.choice([0, 1, 2, 5, 64, 100_000 if r.random() < 0.05 else 3])
                vals = [self.scalar(f) for _ in range(min(n, 8))]
                getattr(msg, f.name)[:] = (vals * (n // max(1, len(vals)) + 1))[:n]
            else:
                setattr(msg, f.name, self.scalar(f))

    def tensor(self, t: tensor_pb2.Tensor) -> None:
        """A tensor's dtype, shape or bytes made wrong, or its values non-finite."""
        r = self.rng
        how = r.choice(["dtype", "shape", "bytes", "values", "clear", "rank", "huge", "reshape"])
        elt = {"float32": 4, "int32": 4, "int64": 8, "bfloat16": 2, "float16": 2}
        if how == "dtype":
            t.dtype = r.choice(_DTYPES)
        elif how == "shape":
            dims = list(t.shape) or [1]
            i = r.randrange(len(dims))
            dims[i] = r.choice([0, -1, 1, dims[i] + 1, dims[i] * 2, 2**31, 2**62, -(2**63)])
            t.shape[:] = dims
        elif how == "rank":
            t.shape[:] = [r.choice([0, 1, 2, 3]) for _ in range(r.choice([0, 1, 2, 4, 5]))]
        elif how == "bytes":
            cut = r.choice([0, 1, len(t.data) // 2, max(0, len(t.data) - 1), len(t.data) + 3])
            t.data = (t.data + r.randbytes(8))[:cut]
        elif how == "values":
            n = len(t.data)
            if t.dtype == "float32" and n >= 4 and r.random() < 0.6:
                fill = struct.pack("<f", r.choice([math.nan, math.inf, -math.inf, 3.4e38]))
                pos = r.randrange(n // 4) * 4
                t.data = t.data[:pos] + fill + t.data[pos + 4 :]
            else:
                t.data = r.randbytes(n)  # random bytes of the right length
        elif how == "clear":
            t.Clear()
        elif how == "reshape":  # another shape with as many bytes as it says: past the byte check
            size = elt.get(t.dtype, 4)
            dims = list(t.shape) or [1]
            for _ in range(r.randint(1, 2)):
                dims[r.randrange(len(dims))] = r.choice([0, 1, 2, 3, 5, 63, 64, 65, 129, 577, 4097])
            if r.random() < 0.2:
                dims = [*dims, r.choice([1, 2])] if r.random() < 0.5 else dims[:-1] or [1]
            numel = math.prod(dims)
            if numel * size > 8 << 20:
                dims[0] = max(1, (8 << 20) // (size * math.prod(dims[1:]) or 1))
                numel = math.prod(dims)
            t.shape[:] = dims
            if t.dtype in ("float32", "bfloat16", "float16") and r.random() < 0.7:
                dtype = getattr(torch, t.dtype)
                t.data = torch.randn(numel).to(dtype).view(torch.uint8).numpy().tobytes()
            elif t.dtype in ("int32", "int64") and r.random() < 0.7:
                vals = torch.randint(-2, 400, (numel,), dtype=getattr(torch, t.dtype))
                t.data = vals.view(torch.uint8).numpy().tobytes()
            else:
                t.data = r.randbytes(numel * size)
        else:  # a huge declared shape with little or no data
            size = elt.get(t.dtype, 4)
            t.shape[:] = [r.choice([2**20, 2**28, 2**40]), *t.shape[1:]]
            t.data = b"" if r.random() < 0.7 else r.randbytes(size * 1024)

    def bytes_(self, raw: bytes) -> bytes:
        """The serialised message truncated, bit-flipped, spliced or replaced."""
        r = self.rng
        how = r.choice(["truncate", "flip", "insert", "random", "tag"])
        if how == "truncate" and raw:
            return raw[: r.randrange(len(raw))]
        if how == "flip" and raw:
            b = bytearray(raw)
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            return bytes(b)
        if how == "insert":
            i = r.randrange(len(raw) + 1)
            return raw[:i] + r.randbytes(r.randint(1, 16)) + raw[i:]
        if how == "tag":  # a field number that is not in the message, or a wrong wire type
            return raw + bytes([r.randrange(256), r.randrange(256)]) + r.randbytes(4)
        return r.randbytes(r.choice([1, 2, 7, 64, 512]))


def _repeated(f: FD) -> bool:
    return bool(f.is_repeated)


def _junk_str(r: random.Random) -> str:
    alphabet = "abcXYZ019 /._-:\t\n\x7fé€漢🙂"
    return "".join(r.choice(alphabet) for _ in range(r.choice([1, 7, 32, 200])))


@dataclass(frozen=True, slots=True)
class Case:
    target: Target
    kind: str  # valid, fields, tensor, bytes, huge
    raw: bytes
    address: str


def draw(
    rng: random.Random,
    ctx: Ctx,
    addresses: dict[str, list[str]],
    targets: list[Target] | None = None,
) -> Case:
    """One request: an RPC at random (of ``targets``, default all), its valid request, and
    maybe a mutation."""
    target = rng.choice(targets or TARGETS)
    addr = rng.choice(addresses[target.service])
    if target.service == "holder":
        msg = _holder_requests(ctx, addr, rng)[target.method]
    elif target.service == "coordinator":
        msg = _coordinator_requests(ctx, rng)[target.method]
    else:
        msg = _agent_requests(ctx, rng)[target.method]
    m = Mutator(rng, ctx)
    kind = rng.choices(["valid", "fields", "tensor", "bytes", "huge"], [15, 35, 30, 15, 5])[0]
    tensors = [
        getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
        if f.type == FD.TYPE_MESSAGE and f.message_type.full_name == "corpusd.v1.Tensor"
    ]
    if kind == "tensor" and not tensors:
        kind = "fields"
    if kind == "fields":
        m.fields(msg)
    elif kind == "tensor":
        m.tensor(rng.choice(tensors))
    elif kind == "huge":
        _huge(rng, msg)
    _spare(ctx, target, msg)
    raw = msg.SerializeToString()
    if kind == "bytes":
        raw = m.bytes_(raw)
    return Case(target, kind, raw, addr)


def _spare(ctx: Ctx, target: Target, msg: Any) -> None:
    """Keep the fuzzer from doing what a valid request may: release or unpin the corpus under
    test, delete the victim from the store, re-register a real holder at another address, or
    bind the agent to the victim corpus that the fuzzer unpins at any moment. A client with
    those rights could; the fuzzer tests what bad input does, not what an admin's does."""
    if target.method in ("Release", "Unpin") and ctx.names_corpus(msg.corpus_id):
        msg.corpus_id = ctx.victim_id
    if target.method == "Unpin":
        msg.delete = False  # (unpin --delete takes the victim out of the store for good)
    if target.method == "Delete" and ctx.names_victim(msg.corpus_id):
        msg.corpus_id = "0" * 32
    if target.method == "RegisterHolder" and msg.holder.holder_id in ctx.holder_ids:
        msg.holder.holder_id = "fuzz-" + msg.holder.holder_id
    if target.service == "agent" and ctx.names_victim(getattr(msg, "corpus", "")):
        msg.corpus = ctx.corpus_id  # an agent bound to the victim races its unpin: UNAVAILABLE


def _huge(r: random.Random, msg: Message) -> None:
    """An oversized request: ~5 MB in a string or bytes field, or a 100k-element list."""
    fs = [f for f in msg.DESCRIPTOR.fields if f.type != FD.TYPE_MESSAGE or _repeated(f)]
    if not fs:  # an unknown field of 5 MB (field 15, length-delimited)
        msg.MergeFromString(b"\x7a" + _varint(5 << 20) + b"\0" * (5 << 20))
        return
    f = r.choice(fs)
    if f.type == FD.TYPE_STRING:
        val = "y" * (5 << 20)
        getattr(msg, f.name).append(val) if _repeated(f) else setattr(msg, f.name, val)
    elif f.type == FD.TYPE_BYTES:
        setattr(msg, f.name, b"\1" * (5 << 20))
    elif _repeated(f) and f.type != FD.TYPE_MESSAGE:
        getattr(msg, f.name)[:] = [1] * 100_000
    elif _repeated(f):
        for _ in range(20_000):
            getattr(msg, f.name).add()
    else:
        setattr(msg, f.name, Mutator(r, _NO_CTX).scalar(f))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


_NO_CTX = Ctx("", "", "", "", 0, 0, 0, 0, 0, 0, 0, 0, 0, "", {}, [])


# -- sending and counting ------------------------------------------------------------------------
@dataclass
class Tally:
    """Status codes per RPC; failures kept with what was sent."""

    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[str, str, str, str]] = field(default_factory=list)  # rpc, kind, code, msg
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    def by_code(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, code), n in self.codes.items():
            out[code] += n
        return out

    def table(self) -> str:
        codes = sorted({c for _, c in self.codes})
        rpcs = sorted({r for r, _ in self.codes})
        w = max(len(r) for r in rpcs) if rpcs else 10
        short = {c: c.replace("INVALID_ARGUMENT", "INVALID_ARG")[:12] for c in codes}
        lines = [f"{'rpc':<{w}} " + " ".join(f"{short[c]:>12}" for c in codes)]
        for r in rpcs:
            lines.append(f"{r:<{w}} " + " ".join(f"{self.codes[(r, c)]:>12}" for c in codes))
        lines.append(f"{'total':<{w}} " + " ".join(f"{self.by_code()[c]:>12}" for c in codes))
        return "\n".join(lines)


class Fuzzer:
    """Sends drawn requests to the daemons, ``concurrency`` at a time, and tallies answers."""

    def __init__(
        self,
        ctx: Ctx,
        addresses: dict[str, list[str]],
        seed: int,
        only: frozenset[str] = frozenset(),
    ) -> None:
        """``only``: the RPCs to fuzz (``holder.Attend``, or a service: ``agent``); all when
        empty."""
        self.ctx, self.addresses, self.rng = ctx, addresses, random.Random(seed)
        self.targets = [
            t for t in TARGETS if not only or t.name in only or t.service in only
        ] or list(TARGETS)
        torch.manual_seed(seed)
        opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.channels = {
            a: grpc.aio.insecure_channel(a, options=opts) for al in addresses.values() for a in al
        }
        self.tally = Tally()

    async def close(self) -> None:
        for s in list(self.ctx.sessions):
            await self._close_session(s)
        for ch in self.channels.values():
            await ch.close()

    async def send(self, case: Case) -> tuple[grpc.StatusCode, str, bytes]:
        ch = self.channels[case.address]
        try:
            if case.target.streaming:
                replies = [
                    r async for r in ch.unary_stream(case.target.path)(case.raw, timeout=DEADLINE_S)
                ]
                return S.OK, "", replies[-1] if replies else b""
            reply = await ch.unary_unary(case.target.path)(case.raw, timeout=DEADLINE_S)
            return S.OK, "", reply
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", b""

    async def _close_session(self, sid: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            req = agent_pb2.CloseSessionRequest(session_id=sid).SerializeToString()
            await self.channels[self.addresses["agent"][0]].unary_unary(
                "/corpusd.v1.Agent/CloseSession"
            )(req, timeout=DEADLINE_S)
        if sid in self.ctx.sessions:
            self.ctx.sessions.remove(sid)

    async def one(self, case: Case) -> None:
        code, detail, reply = await self.send(case)
        t = case.target
        self.tally.codes[(t.name, code.name)] += 1
        self.tally.kinds[case.kind] += 1
        if code in BAD and code not in ALSO_FINE.get((t.service, t.method), frozenset()):
            self.tally.failures.append((t.name, case.kind, code.name, detail[:300]))
        if t.name == "agent.OpenSession" and code == S.OK:
            sid = agent_pb2.OpenSessionResponse.FromString(reply).session_id
            self.ctx.sessions.append(sid)
            if len(self.ctx.sessions) > 12:  # bounded: the agent's session cap is not the point
                await self._close_session(self.ctx.sessions[0])

    async def run(self, n: int, concurrency: int = 8) -> Tally:
        t0 = time.perf_counter()
        queue: asyncio.Queue[Case | None] = asyncio.Queue(maxsize=concurrency * 2)

        async def worker() -> None:
            while (case := await queue.get()) is not None:
                await self.one(case)

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        for _ in range(n):
            await queue.put(draw(self.rng, self.ctx, self.addresses, self.targets))
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
        self.tally.seconds += time.perf_counter() - t0
        return self.tally


# -- the daemons under test --------------------------------------------------------------------
@dataclass
class FuzzCluster:
    coord: CoordinatorProcess
    holders: list[HolderProcess]
    agent: AgentProcess
    ctx: Ctx
    store: Path

    @property
    def daemons(self) -> dict[str, Any]:
        return {
            "coordinator": self.coord,
            **{f"holder{i}": h for i, h in enumerate(self.holders)},
            "agent": self.agent,
        }

    @property
    def addresses(self) -> dict[str, list[str]]:
        return {
            "holder": [h.address for h in self.holders],
            "coordinator": [self.coord.address],
            "agent": [self.agent.address],
        }

    def alive(self) -> dict[str, bool]:
        return {name: d.proc.poll() is None for name, d in self.daemons.items()}

    def rss_kib(self) -> dict[str, int]:
        out = {}
        for name, d in self.daemons.items():
            status = Path(f"/proc/{d.proc.pid}/status")
            if d.proc.poll() is not None or not status.exists():
                continue
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[name] = int(line.split()[1])
        return out


@contextlib.contextmanager
def fuzz_cluster(tmp: Path, model_dir: Path, corpus_tokens: int = 300) -> Iterator[FuzzCluster]:
    """A coordinator, two holders and an agent worker on loopback; a corpus pinned and published
    (two replicas: each holder has every page), and a small victim corpus in the store."""
    cid = pin_sample(tmp, model_dir, tokens=corpus_tokens)
    store = tmp / "store"
    victim = synthetic_corpus(store, model_dir, 150, seed=7)
    coord = start_coordinator(tmp / "coord", store, "--rpc-timeout-s", "5")
    started: list[Any] = [coord]
    try:
        holders = start_holders(
            store, tmp, model_dir, coord.address, 2, "--capacity-tokens", "4096", "--threads", "1"
        )
        started += holders
        agent = start_agent(
            store, tmp / "agent", model_dir, "--coordinator", coord.address,
            "--max-prompt-tokens", "64", "--max-new-tokens", "8", "--max-sessions", "64",
            "--report-s", "0.5", "--threads", "1", "--primitive", "route",
        )  # fmt: skip
        started.append(agent)
        ctx = asyncio.run(_context(coord.address, store, model_dir, cid, victim))
        yield FuzzCluster(coord, holders, agent, ctx, store)
    finally:
        for d in reversed(started):
            d.stop()


async def _context(coord: str, store: Path, model_dir: Path, cid: str, victim: str) -> Ctx:
    mc = ModelConfig.from_dir(model_dir)
    async with CoordinatorClient(coord) as c:
        await c.wait_holders(2)
        table = await c.pin(cid, replicas=2, wait=True, timeout=60)
    m = PageStore(store).manifest(cid)
    return Ctx(
        corpus_id=cid,
        corpus_name=m.name,
        victim_id=victim,
        victim_name=PageStore(store).manifest(victim).name,
        tokens=m.token_count,
        n_pages=m.n_pages,
        page_size=m.page_size,
        n_layers=mc.num_hidden_layers,
        heads=mc.num_attention_heads,
        kv_dim=mc.kv_dim,
        index_heads=mc.index_n_heads,
        index_dim=mc.index_head_dim,
        vocab=mc.vocab_size,
        fingerprint=fingerprint(model_dir),
        holders={table.address(h): table.frames_on(h) for h in table.holders},
        holder_ids=sorted(table.holders),
    )


async def decode(agent: str, corpus: str, prompt: list[int], tokens: int) -> list[int]:
    """A normal session on ``agent``: ``tokens`` greedy tokens after ``prompt``."""
    async with grpc.aio.insecure_channel(agent) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        s = await stub.OpenSession(
            agent_pb2.OpenSessionRequest(corpus=corpus, tokens=agent_pb2.TokenList(ids=prompt))
        )
        out: list[int] = []
        async for chunk in stub.Generate(
            agent_pb2.GenerateRequest(
                session_id=s.session_id, params=agent_pb2.SamplingParams(max_tokens=tokens)
            )
        ):
            out += list(chunk.token_ids)
        await stub.CloseSession(agent_pb2.CloseSessionRequest(session_id=s.session_id))
        return out
