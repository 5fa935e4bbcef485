"""The Agent API end to end: a coordinator, 3 holders and a `corpusd agent` as real processes.

A 700-token corpus (5.5× index_topk) is published through the coordinator with two replicas per
page; sub-agents open sessions through `requester.Client` and their greedy tokens must equal
transformers' `DeepseekV32ForCausalLM.generate` on [corpus + suffix]. Also: bad input gets a
precise status and the agent keeps serving; the low-level Attend equals the torch reference;
the coordinator SIGKILLed mid-generation costs no token; a holder SIGKILLed is served by its
replicas.
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorClient, PageTable
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.kernels.reference import partial_attention
from corpusd.model import ModelConfig
from corpusd.model.tiny import TOKENIZER_JSON
from corpusd.testing.holders import pin_sample, start_holders
from corpusd.testing.numeric import rel
from corpusd.testing.oracle import Oracle
from corpusd.tokenizer import HFTokenizer
from holder.launch import HolderProcess
from indexer import index_scores
from indexer.select import select_topk
from requester.ask import PROMPT, ask, printable
from requester.client import AgentError, Client
from requester.launch import AgentProcess, start_agent
from tests.support.checks import metric

CORPUS_TOKENS, NEW = 700, 24
SUFFIXES = [f"\nQ{i}: what is on line {i * 41}?" for i in range(3)]
Code = grpc.StatusCode


@dataclass
class Cluster:
    tmp: Path
    cid: str
    tokens: int  # the corpus's length
    coord: CoordinatorProcess
    holders: list[HolderProcess]
    agent: AgentProcess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("agent")
    cid = pin_sample(tmp, tiny_dir, tokens=CORPUS_TOKENS)
    store = tmp / "store"
    coord = start_coordinator(tmp / "coord", store, "--lease-s", "3")
    holders = start_holders(
        store, tmp, tiny_dir, coord.address, 3, "--capacity-tokens", "4096", "--threads", "1"
    )
    agent = start_agent(
        store,
        tmp / "agent",
        tiny_dir,
        "--coordinator",
        coord.address,
        "--max-prompt-tokens",
        "64",
        "--max-new-tokens",
        "32",
        "--report-s",
        "0.3",
        "--threads",
        "1",
        # every layer goes to the holders, so a killed holder is seen (with "auto" the predicate
        # may fetch this small corpus once and never call a holder again)
        "--primitive",
        "route",
    )
    c = Cluster(tmp, cid, PageStore(store).manifest(cid).token_count, coord, holders, agent)

    async def publish() -> None:
        async with CoordinatorClient(coord.address) as cc:
            await cc.wait_holders(3)
            t = await cc.pin(cid, replicas=2, wait=True, timeout=60)
            assert t.corpus.state == "ready" and all(len(r) == 2 for r in t.pages)

    asyncio.run(publish())
    yield c
    for d in (agent, *holders, c.coord):
        d.stop()


@pytest.fixture(scope="module")
def oracle(cluster: Cluster, hf_model) -> Oracle:  # type: ignore[no-untyped-def]
    """transformers' greedy answers, computed at the first test's check from its tokens."""
    toks = PageStore(cluster.tmp / "store").read_tokens(cluster.cid)
    return Oracle(hf_model, toks, SUFFIXES, NEW)


# The CPU default's BPE (the cluster's model is ``corpusd model init``'s)
_DEFAULT_TOKENIZER = HFTokenizer(TOKENIZER_JSON, 0, 1)


async def run_sessions(client: Client, corpus: str, n_tokens: int) -> list[list[int]]:
    async def one(sfx: str) -> list[int]:
        s = await client.open_session(corpus, list(sfx.encode()))
        r = await client.complete(s, max_tokens=n_tokens)
        assert r.finish_reason == "length" and len(r.token_ids) == n_tokens
        # the streamed text is the detokenised answer (a trailing partial character held back)
        assert _DEFAULT_TOKENIZER.decode(list(r.token_ids)).startswith(r.text)
        await client.close_session(s)
        return list(r.token_ids)

    return list(await asyncio.gather(*(one(s) for s in SUFFIXES)))


def test_sub_agents_through_the_api_match_transformers(cluster: Cluster, oracle: Oracle) -> None:
    async def go() -> list[list[int]]:
        async with Client(coordinator=cluster.coord.address) as c:
            return await run_sessions(c, "repo", 8)  # by name; the worker chosen by the coordinator

    got = asyncio.run(go())
    assert got == oracle.tokens(got, n=8)
    port = cluster.agent.metrics_port
    # the three sessions were stepped together, and the corpus was routed to the holders
    assert metric(port, "corpusd_requester_batch_sessions_sum") > metric(
        port, "corpusd_requester_batch_sessions_count"
    )
    assert metric(port, "corpusd_requester_decisions_total", 'primitive="route"') > 0
    assert metric(port, "corpusd_requester_requests_total", 'method="Generate"', 'code="OK"') == 3


def test_bad_input_gets_a_precise_status_and_the_agent_keeps_serving(
    cluster: Cluster, oracle: Oracle
) -> None:
    async def go() -> None:
        async with Client(agent=cluster.agent.address) as c:

            async def refused(code: grpc.StatusCode, words: str, call) -> None:  # type: ignore[no-untyped-def]
                with pytest.raises(AgentError) as e:
                    await call
                assert e.value.code == code, e.value
                assert words in e.value.detail, e.value.detail

            await refused(Code.NOT_FOUND, "unknown corpus 'nope'", c.open_session("nope", "hi"))
            await refused(Code.INVALID_ARGUMENT, "corpus: empty", c.open_session("", "hi"))
            await refused(Code.INVALID_ARGUMENT, "at most 64", c.open_session("repo", [5] * 65))
            await refused(Code.INVALID_ARGUMENT, "prompt: empty", c.open_session("repo", []))
            await refused(
                Code.INVALID_ARGUMENT, "outside [0, 16384)", c.open_session("repo", [16400])
            )
            # the corpus sent again as the prompt (its text: no BOS) would be attended twice:
            # refused, naming it
            text = PageStore(cluster.tmp / "store").read_tokens(cluster.cid)[1:65].tolist()
            await refused(
                Code.INVALID_ARGUMENT,
                "prompt: repeats corpus 'repo' (its tokens 1-64 stand at the prompt's 0-63)",
                c.open_session("repo", text),
            )
            port = cluster.agent.metrics_port  # what an operator sees of it
            counted = ("corpusd_requester_prompts_refused_total", 'reason="repeats_corpus"')
            assert metric(port, *counted) == 1
            s = await c.open_session(cluster.cid[:10], list(SUFFIXES[0].encode()))  # id prefix
            for kw, words in [
                ({"max_tokens": 33}, "at most 32"),
                ({"temperature": -1.0}, "temperature"),
                ({"temperature": float("nan")}, "temperature"),
                ({"top_p": 1.5}, "top_p"),
                ({"stop_token_ids": [99999]}, "stop_token_ids"),
            ]:
                await refused(Code.INVALID_ARGUMENT, words, c.complete(s, **kw))
            ghost = type(s)("0" * 16, s.address, 0, 0)
            await refused(Code.NOT_FOUND, "no session", c.complete(ghost))
            await refused(Code.NOT_FOUND, "no session", c.close_session(ghost))
            q = torch.randn(2, 64, 576)
            await refused(Code.INVALID_ARGUMENT, "give positions", c.attend("repo", 0, q))
            await refused(Code.INVALID_ARGUMENT, "layer", c.attend("repo", 9, q, torch.zeros(2, 4)))
            await refused(
                Code.INVALID_ARGUMENT, "q: shape", c.attend("repo", 0, q[:, :8], torch.zeros(2, 4))
            )
            t = cluster.tokens
            await refused(
                Code.INVALID_ARGUMENT,
                f"outside [-1, {t})",
                c.attend("repo", 0, q, torch.full((2, 4), t)),
            )
            # nothing above changed anything: the session still decodes the oracle's tokens
            r = await c.complete(s, max_tokens=4)
            got = list(r.token_ids)
            assert got == oracle.answer(0, got, n=4)[0]
            await refused(Code.FAILED_PRECONDITION, "finished", c.complete(s, max_tokens=4))
            await c.close_session(s)

    asyncio.run(go())


def test_attend_equals_the_torch_reference(cluster: Cluster, tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    store = PageStore(cluster.tmp / "store")
    layer, n, k = 1, 5, 48
    m = store.manifest(cluster.cid)
    lat, keys = store.read_pages(cluster.cid, layer, list(range(m.n_pages)))
    rows = lat.reshape(-1, cfg.kv_dim)[: cluster.tokens]
    ikeys = keys.reshape(-1, cfg.index_head_dim)[: cluster.tokens]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, cfg.num_attention_heads, cfg.kv_dim, generator=g)
    pos = torch.randint(-1, cluster.tokens, (n, k), generator=g)
    pos[0] = -1  # an empty row: O = 0, LSE = -inf
    iq = torch.randn(n, cfg.index_n_heads, cfg.index_head_dim, generator=g)
    iw = torch.randn(n, cfg.index_n_heads, generator=g)

    async def go() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        async with Client(agent=cluster.agent.address) as c:
            by_pos = await c.attend(cluster.cid, layer, q, positions=pos)
            by_index = await c.attend(cluster.cid, layer, q, index_q=iq, index_weights=iw)
            return by_pos, by_index

    (o1, l1), (o2, l2) = asyncio.run(go())
    ro, rl = partial_attention(q, rows, pos, cfg.softmax_scale, cfg.kv_lora_rank)
    assert torch.isinf(l1[0]).all() and (o1[0] == 0).all()
    assert rel(o1[1:], ro[1:]) < 1e-5 and torch.allclose(l1[1:], rl[1:], atol=1e-5)
    sel = select_topk(index_scores(iq, iw, ikeys, cfg.index_head_dim**-0.5), cfg.index_topk)
    ro, rl = partial_attention(q, rows, sel, cfg.softmax_scale, cfg.kv_lora_rank)
    assert rel(o2, ro) < 1e-5 and torch.allclose(l2, rl, atol=1e-5)


def test_corpusd_ask_streams_the_answer_the_api_gives(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """`corpusd ask` (issue 19): one question, its answer written to stdout chunk by chunk as
    the worker makes it, the same text as a `Client`'s greedy completion of the same prompt;
    bad input exits 2 with one line."""
    addr, question = cluster.coord.address, "what is on line 41?"

    async def api() -> str:
        async with Client(coordinator=addr) as c:
            s = await c.open_session(cluster.cid, PROMPT.format(question=question))
            done = await c.complete(s, max_tokens=12)
            await c.close_session(s)
            return done.text

    writes: list[str] = []

    class Out(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    out, err = Out(), io.StringIO()
    finish = asyncio.run(ask(cluster.cid, question, out, err, coordinator=addr, max_tokens=12))
    want = printable(asyncio.run(api())) + "\n"
    assert finish == "length" and out.getvalue() == want
    assert len([w for w in writes if w]) >= 3, writes  # streamed, not written once at the end
    assert err.getvalue().startswith("(the built-in tiny model has random weights")
    assert re.search(r"\[12 tokens, length; first token [\d,]+ ms, then", err.getvalue())

    rc = cli_main(["ask", question, "--corpus", cluster.cid[:8], "--max-tokens", "12",
                   "--coordinator", addr])  # fmt: skip
    assert rc == 0 and capsys.readouterr().out == want
    for args, words in (
        (["--corpus", "nosuch", "q"], "NOT_FOUND: unknown corpus 'nosuch'"),
        (["--corpus", cluster.cid, ""], "the question is empty"),
        (["--corpus", cluster.cid, "q", "--max-tokens", "0"], "--max-tokens must be in 1..4096"),
        (["--corpus", cluster.cid, "q", "--max-tokens", "40"], "INVALID_ARGUMENT"),  # agent: 32
    ):
        assert cli_main(["ask", *args, "--coordinator", addr]) == 2, args
        got = capsys.readouterr().err
        assert got.startswith("corpusd: error: ") and words in got and got.count("\n") == 1, got


def test_coordinator_killed_mid_generation_costs_no_token(cluster: Cluster, oracle: Oracle) -> None:
    port = cluster.coord.address.rsplit(":", 1)[1]

    async def before() -> tuple[PageTable, list[list[int]], list[int]]:
        async with CoordinatorClient(cluster.coord.address) as cc:
            table = await cc.page_table(cluster.cid)
        async with Client(agent=cluster.agent.address) as c:
            sessions = [await c.open_session("repo", list(s.encode())) for s in SUFFIXES]
            streams = [c.generate(s, max_tokens=NEW) for s in sessions]
            got: list[list[int]] = [[] for _ in sessions]
            firsts = [await st.__anext__() for st in streams]
            for i, ch in enumerate(firsts):
                got[i] += ch.token_ids
            cluster.coord.kill()  # SIGKILL while the three are mid-answer

            async def rest(i: int) -> None:
                async for ch in streams[i]:
                    got[i] += ch.token_ids

            await asyncio.gather(*(rest(i) for i in range(len(streams))))
            # the bound corpus still opens sessions; an unbound one says why it cannot
            s = await c.open_session(cluster.cid, list(SUFFIXES[1].encode()))
            late = list((await c.complete(s, max_tokens=3)).token_ids)
            with pytest.raises(AgentError) as e:
                await c.open_session("other-corpus", "hi")
            assert e.value.code == Code.UNAVAILABLE and "coordinator" in e.value.detail
        return table, got, late

    table, got, late = asyncio.run(before())
    assert got == oracle.tokens(got) and late == oracle.tokens()[1][:3]
    cluster.coord = start_coordinator(
        cluster.tmp / "coord", cluster.tmp / "store", "--lease-s", "3", "--port", port
    )

    async def after() -> None:
        async with CoordinatorClient(cluster.coord.address) as cc:
            now = await cc.page_table(cluster.cid)
            assert now.pages == table.pages and now.corpus.tokens == cluster.tokens  # intact
            for _ in range(100):  # the agent reports again within its period
                if any(w.live for w in await cc.list_workers()):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the agent did not report to the restarted coordinator")

    asyncio.run(after())
    assert metric(cluster.agent.metrics_port, "corpusd_requester_reprefilled_tokens_total") == 0


def test_a_killed_holder_is_served_by_its_replicas(cluster: Cluster, oracle: Oracle) -> None:
    port = cluster.agent.metrics_port
    bound = _bound(cluster)
    victim = next(h for h in cluster.holders if h.address in bound)
    victim.kill()  # it holds pages the agent routes to; each also has a replica elsewhere

    async def go() -> list[list[int]]:
        async with Client(agent=cluster.agent.address) as c:
            return await run_sessions(c, "repo", NEW)

    got = asyncio.run(go())
    assert got == oracle.tokens(got)
    assert metric(port, "corpusd_requester_reprefilled_tokens_total") == 0
    assert metric(port, "corpusd_requester_fallbacks_total", 'to="replica"') >= 1
    assert metric(port, "corpusd_requester_fallbacks_total", 'to="local"') == 0


def _bound(cluster: Cluster) -> set[str]:
    async def go() -> set[str]:
        async with CoordinatorClient(cluster.coord.address) as cc:
            t = await cc.page_table(cluster.cid)
        return {t.address(h) for reps in t.pages for h, _ in reps}

    return asyncio.run(go())
