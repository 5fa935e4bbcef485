"""The agent's OpenAI-compatible HTTP API (issue 19), through the official ``openai`` client
against a real `corpusd agent --http-port 0` beside a coordinator and a holder on loopback.

Eight concurrent streamed chat completions give, token for token, what the gRPC Agent API gives
for the same prompt; completions whole and streamed, stop strings, the seed of a sampled answer;
every documented refusal with its HTTP status and OpenAI error body, the agent serving on after
them; a client that leaves mid-stream closes its session.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.model import ModelConfig
from corpusd.testing.holders import start_holders, synthetic_corpus
from corpusd.tokenizer import load_tokenizer
from holder.launch import HolderProcess
from requester.client import AgentError, Client
from requester.launch import AgentProcess, start_agent
from requester.openai_api import chat_text
from tests.support.checks import metric

openai = pytest.importorskip("openai", reason="the OpenAI client is a test dependency: .[test]")

MAX_NEW = 24


@dataclass
class Http:
    cid: str
    tok: Any  # the model's tokenizer (the CPU default's BPE, or bytes)
    coord: CoordinatorProcess
    holder: HolderProcess
    agent: AgentProcess

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.agent.http_port}/v1"

    def client(self) -> Any:
        return openai.AsyncOpenAI(base_url=self.base, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Http]:
    tmp = tmp_path_factory.mktemp("http")
    store = tmp / "store"
    cid = synthetic_corpus(store, tiny_dir, 300, name="docs")
    coord = start_coordinator(tmp / "coord", store)
    (holder,) = start_holders(store, tmp, tiny_dir, coord.address, 1, "--capacity-tokens", "1024")
    agent = start_agent(
        store, tmp / "agent", tiny_dir, "--coordinator", coord.address, "--http-port", "0",
        "--max-new-tokens", str(MAX_NEW), "--max-prompt-tokens", "256", "--threads", "1",
        "--primitive", "route", "--report-s", "0.3",
    )  # fmt: skip

    async def publish() -> None:
        async with CoordinatorClient(coord.address) as cc:
            await cc.wait_holders(1)
            await cc.pin(cid, replicas=1, wait=True, timeout=60)

    asyncio.run(publish())
    cfg = ModelConfig.from_dir(tiny_dir)
    tok = load_tokenizer(tiny_dir, cfg.bos_token_id, cfg.eos_token_id)
    yield Http(cid, tok, coord, holder, agent)
    for d in (agent, holder, coord):
        d.stop()


async def grpc_tokens(address: str, corpus: str, prompt: list[int], n: int, **kw: Any) -> list[int]:
    async with Client(agent=address) as c:
        s = await c.open_session(corpus, prompt)
        r = await c.complete(s, max_tokens=n, **kw)
        await c.close_session(s)
        return list(r.token_ids)


def test_eight_streamed_chats_give_the_grpc_apis_tokens(http: Http) -> None:
    questions = [f"what does file {i} define?" for i in range(8)]

    async def chat(q: str) -> tuple[list[int], list[int], str, str]:
        async with http.client() as c:
            stream = await c.chat.completions.create(
                model="docs",
                messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": q},
                ],
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True},
            )
            ids: list[int] = []
            prompt: list[int] = []
            text, finish, usage = [], "", None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for ch in chunk.choices:
                    extra = ch.model_extra or {}
                    prompt = extra.get("prompt_token_ids", prompt)
                    ids += extra["token_ids"]
                    text.append(ch.delta.content or "")
                    finish = ch.finish_reason or finish
            assert usage is not None and usage.completion_tokens == len(ids) == 12
            assert usage.prompt_tokens == len(prompt)
            return prompt, ids, "".join(text), finish

    got = asyncio.run(_gather(chat(q) for q in questions))
    for q, (prompt, ids, text, finish) in zip(questions, got, strict=True):
        # the documented template, in the tiny model's byte tokens, after the corpus
        want = chat_text([("system", "be brief"), ("user", q)], deepseek=False)
        assert prompt == list(http.tok.encode(want)) and finish == "length"
        assert http.tok.decode(list(ids)).startswith(text)
    want_ids = asyncio.run(_gather(grpc_tokens(http.agent.address, "docs", p, 12) for p, *_ in got))
    assert [g[1] for g in got] == want_ids
    # they were stepped together, not one after another
    port = http.agent.metrics_port
    assert metric(port, "corpusd_requester_batch_sessions_sum") > 2 * metric(
        port, "corpusd_requester_batch_sessions_count"
    )


async def _gather(coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros))


def test_completions_whole_and_streamed_stop_strings_and_seed(http: Http) -> None:
    prompt = "\n\nQ: where is the page store?\nA:"
    ids = list(http.tok.encode(prompt))

    async def go() -> None:
        async with http.client() as c:
            whole = await c.completions.create(
                model=http.cid[:10], prompt=prompt, max_tokens=10, temperature=0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            (ch,) = whole.choices
            toks = ch.model_extra["token_ids"]
            assert toks == await grpc_tokens(http.agent.address, http.cid, ids, 10)
            assert ch.finish_reason == "length" and whole.usage.total_tokens == len(ids) + 10
            assert whole.model == http.cid[:10] and whole.object == "text_completion"
            streamed = await c.completions.create(
                model="docs", prompt=ids, max_tokens=10, temperature=0, stream=True
            )
            text = "".join([x.choices[0].text async for x in streamed])
            assert text == ch.text
            # the corpus named in the extra field, whatever the model is called
            sampled = await c.completions.create(
                model="gpt-whatever", prompt=prompt, max_tokens=8, temperature=0.9, seed=7,
                extra_body={"corpus": "docs", "return_token_ids": True},
            )  # fmt: skip
            want = await grpc_tokens(
                http.agent.address, "docs", ids, 8, temperature=0.9, seed=7, top_p=1.0
            )
            assert sampled.choices[0].model_extra["token_ids"] == want
            # a stop string: the text is cut before it and finish_reason is "stop"
            assert len(ch.text) > 3, ch.text
            stop = ch.text[2:4]
            cut = await c.completions.create(
                model="docs", prompt=prompt, max_tokens=10, temperature=0, stop=["\x00Z", stop]
            )
            assert cut.choices[0].text == ch.text[: ch.text.find(stop)]
            assert cut.choices[0].finish_reason == "stop"
            models = await c.models.list()
            assert [(m.id, m.model_extra["corpus_id"]) for m in models.data] == [("docs", http.cid)]

    asyncio.run(go())


def _post(http: Http, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        http.base + path, body, {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# past 256 prompt tokens in any tokenizer (bytes, or the CPU default's BPE)
LONG = " ".join(f"q{i}z{i * 7919 % 1009}" for i in range(400))


def test_bad_requests_get_openai_errors_and_change_nothing(http: Http) -> None:
    chat = [{"role": "user", "content": "hi"}]

    async def refused(kind: Any, status: int, param: str | None, words: str, **kw: Any) -> None:
        async with http.client() as c:
            with pytest.raises(kind) as e:
                await c.chat.completions.create(**{"model": "docs", "messages": chat, **kw})
        assert e.value.status_code == status
        err = e.value.body
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["param"] == param and words in err["message"], err

    async def go() -> None:
        await refused(openai.NotFoundError, 404, "model", "unknown corpus 'nope'", model="nope")
        await refused(
            openai.BadRequestError, 400, "max_tokens", f"at most {MAX_NEW}", max_tokens=MAX_NEW + 1
        )
        await refused(openai.BadRequestError, 400, "max_tokens", "must be >= 1", max_tokens=0)
        await refused(openai.BadRequestError, 400, "temperature", "must be >= 0", temperature=-1)
        await refused(openai.BadRequestError, 400, "messages", "non-empty", messages=[])
        await refused(openai.BadRequestError, 400, "messages[0].role", "'robot'",
                      messages=[{"role": "robot", "content": "x"}])  # fmt: skip
        await refused(openai.BadRequestError, 400, "n", "only 1", n=2)
        await refused(openai.BadRequestError, 400, "messages", "at most 256",
                      messages=[{"role": "user", "content": LONG}])  # fmt: skip
        # refused while streaming is asked: the error comes before any event
        await refused(openai.NotFoundError, 404, "model", "unknown corpus", model="x", stream=True)

    asyncio.run(go())
    for path, body, status, code in [
        ("/chat/completions", b"{not json", 400, "invalid_json"),
        ("/chat/completions", b"[1, 2]", 400, "invalid_body"),
        ("/chat/completions", b'{"model": "docs"}', 400, "missing_required_parameter"),
        ("/completions", b'{"model": "docs", "prompt": {"a": 1}}', 400, "invalid_type"),
        ("/completions", b'{"model": 5, "prompt": "x"}', 400, "invalid_type"),
        ("/completions", b'{"prompt": "x"}', 400, "missing_required_parameter"),
        ("/nowhere", b"{}", 404, None),
    ]:
        got, err = _post(http, path, body)
        assert got == status and err["error"]["code"] == code, (path, body, err)
        assert err["error"]["type"] == "invalid_request_error", err
    # the agent serves on, and no refused request left a session open
    assert _sessions(http) == 0
    got, ok = _post(http, "/completions", b'{"model": "docs", "prompt": "x", "max_tokens": 2}')
    assert got == 200 and ok["choices"][0]["finish_reason"] == "length"


def test_random_bodies_get_a_4xx_or_an_answer_never_a_500(http: Http) -> None:
    """Bodies drawn around valid ones (fields dropped, values swapped for other JSON types and
    edge values): each gets an answer or an OpenAI error below 500, and the agent serves on."""
    rng = random.Random(19)
    values: list[Any] = [None, True, 0, -1, 1, 2**64, 1.5, float("nan"), "", "x", "docs", [], [1],
                         [[1]], ["a", "b"], {}, {"type": "text"}, [{"role": "user"}]]  # fmt: skip
    base = {
        "/completions": {"model": "docs", "prompt": "x", "max_tokens": 1, "temperature": 0},
        "/chat/completions": {
            "model": "docs", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "x"}],
        },
    }  # fmt: skip
    keys = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "stop", "seed",
            "n", "stream", "stop_token_ids", "corpus", "logprobs", "echo", "stream_options",
            "max_completion_tokens", "response_format", "return_token_ids"]  # fmt: skip
    codes: dict[int, int] = {}
    for _ in range(150):
        path = rng.choice(list(base))
        body: dict[str, Any] = dict(base[path])
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(keys)
            if rng.random() < 0.3:
                body.pop(key, None)
            else:
                body[key] = rng.choice(values)
        if body.get("stream") is True:
            body["stream"] = False  # an SSE body is not JSON; streaming is tested above
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 2:
            body["max_tokens"] = 2  # keep the valid ones short
        raw = json.dumps(body).encode()
        status, reply = _post(http, path, raw)
        codes[status] = codes.get(status, 0) + 1
        assert status in (200, 400, 404), (body, status, reply)
        if status != 200:
            assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert codes.get(400, 0) > 30 and codes.get(200, 0) > 5, codes
    assert _sessions(http) == 0


def _sessions(http: Http, want: float = 0, wait_s: float = 10) -> float:
    """The agent's open sessions, waited for until ``want`` (the gauge follows the request)."""
    deadline = time.monotonic() + wait_s
    while (n := metric(http.agent.metrics_port, "corpusd_requester_sessions")) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return n


def test_a_client_that_leaves_mid_stream_closes_its_session(http: Http) -> None:
    async def go() -> None:
        async with http.client() as c:
            stream = await c.chat.completions.create(
                model="docs", messages=[{"role": "user", "content": "a long answer"}],
                max_tokens=MAX_NEW, temperature=0, stream=True,
            )  # fmt: skip
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.close()

    asyncio.run(go())
    assert _sessions(http) == 0


def test_unpin_makes_the_agent_drop_the_corpus_and_a_repin_binds_afresh(
    http: Http, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 19: ``corpusd unpin`` tells the agent workers, in the reply to their load report,
    to drop what they hold of the corpus: its binding (page table, index keys, fetched pages)
    and its sessions. Runs last: it unpins the module's corpus (and pins it again)."""
    addr = http.coord.address

    async def bound() -> list[tuple[str, ...]]:
        async with CoordinatorClient(addr) as cc:
            return [w.report.corpora for w in await cc.list_workers()]

    async def before() -> tuple[Any, list[int]]:
        async with Client(agent=http.agent.address) as c:
            s = await c.open_session("docs", list(b"\nQ: x?\nA:"))  # left open
        return s, await grpc_tokens(http.agent.address, "docs", list(b"\nQ: y?\nA:"), 4)

    session, want = asyncio.run(before())
    assert asyncio.run(bound()) == [(http.cid,)]
    assert cli_main(["unpin", "docs", "--coordinator", addr]) == 0
    assert capsys.readouterr().out.startswith("unpinned docs")
    deadline = time.monotonic() + 15
    while asyncio.run(bound()) != [()]:  # the next report (every 0.3 s) drops it
        assert time.monotonic() < deadline, asyncio.run(bound())
        time.sleep(0.2)
    assert _sessions(http) == 0  # the open session went with it

    async def generate() -> None:
        async with Client(agent=http.agent.address) as c:
            with pytest.raises(AgentError, match=r"NOT_FOUND: session .* its corpus .* unpinned"):
                await c.complete(session, max_tokens=2)

    asyncio.run(generate())
    got, err = _post(http, "/completions", b'{"model": "docs", "prompt": "x"}')
    assert got == 404 and "unknown corpus 'docs'" in err["error"]["message"], err
    assert err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model", err
    with urllib.request.urlopen(http.base + "/models", timeout=10) as r:
        assert json.loads(r.read())["data"] == []

    async def repin() -> list[int]:
        async with CoordinatorClient(addr) as cc:
            await cc.pin(http.cid, replicas=1, wait=True, timeout=60)
        return await grpc_tokens(http.agent.address, "docs", list(b"\nQ: y?\nA:"), 4)

    assert asyncio.run(repin()) == want  # bound afresh from the new page table
