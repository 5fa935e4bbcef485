"""The valid requests the fuzzer starts from: one builder per RPC of Holder, Coordinator and
Agent (``TARGETS``), filled from a ``Ctx`` that names the corpus, the model's widths, the holders
and the sessions under test. Mutated by :mod:`corpusd.testing.fuzz_mutate`, sent by
:mod:`corpusd.testing.fuzzing`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from google.protobuf.message import Message

from corpusd.v1 import agent_pb2, coordinator_pb2, holder_pb2, tensor_pb2

SERVICES = {"holder": "Holder", "coordinator": "Coordinator", "agent": "Agent"}


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


def holder_requests(ctx: Ctx, addr: str, rng: random.Random) -> dict[str, Message]:
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


def coordinator_requests(ctx: Ctx, rng: random.Random) -> dict[str, Message]:
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


def agent_requests(ctx: Ctx, rng: random.Random) -> dict[str, Message]:
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
