"""The mutations drawn around a valid request (:mod:`corpusd.testing.fuzz_requests`): fields set to
edge values of their type, tensors given wrong dtypes, shapes or bytes, oversized messages, and
the serialised bytes truncated, bit-flipped or replaced. ``draw`` makes one ``Case`` to send."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message

from corpusd.testing.fuzz_requests import (
    TARGETS,
    Ctx,
    Target,
    agent_requests,
    coordinator_requests,
    holder_requests,
)
from corpusd.v1 import tensor_pb2

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
        msg = holder_requests(ctx, addr, rng)[target.method]
    elif target.service == "coordinator":
        msg = coordinator_requests(ctx, rng)[target.method]
    else:
        msg = agent_requests(ctx, rng)[target.method]
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
