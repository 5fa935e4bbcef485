"""The OpenAI API's request checks, chat templates and stop strings (requester/openai_api.py),
without a server; tests/procs/test_openai_http.py runs them behind a real agent."""

from __future__ import annotations

import random

import pytest

from requester.openai_api import ApiError, StopText, chat_text, parse


def test_parse_names_the_corpus_and_the_parameter_at_fault() -> None:
    r = parse({"model": "m", "prompt": [[1, 2, 3]], "stop": "x", "seed": 3}, chat=False)
    assert (r.corpus, r.prompt, r.stop, r.seed, r.temperature) == ("m", [1, 2, 3], ("x",), 3, 1.0)
    r = parse({"model": "gpt", "corpus": "docs", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 5}, chat=True)  # fmt: skip
    assert (r.model, r.corpus, r.messages, r.max_tokens) == ("gpt", "docs", (("user", "ab"),), 5)
    for body, chat, param in [
        ({"prompt": "x"}, False, "model"),
        ({"model": "m"}, False, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, False, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, False, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, False, "temperature"),
        ({"model": "m", "prompt": "x", "stop": ["a"] * 5}, False, "stop"),
        ({"model": "m", "prompt": "x", "stop": [""]}, False, "stop"),
        ({"model": "m", "prompt": "x", "echo": True}, False, "echo"),
        ({"model": "m", "prompt": "x", "seed": -1}, False, "seed"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, True, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            True,
            "messages[0].content[0]",
        ),
        ({"model": "m", "messages": [{"role": "user"}], "tools": [{}]}, True, "tools"),
        ({"model": "m", "messages": [{"role": "user"}], "logprobs": True}, True, "logprobs"),
    ]:
        with pytest.raises(ApiError) as e:
            parse(body, chat)
        assert e.value.status == 400 and e.value.param == param, (body, e.value)
        assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_templates() -> None:
    msgs = [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")]
    assert (
        chat_text(msgs, deepseek=False)
        == "\n\nSystem: S\nUser: U1\nAssistant: A1\nUser: U2\nAssistant:"
    )
    assert chat_text(msgs, deepseek=True) == (
        "S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜></think>"
    )


def test_stop_text_cuts_before_the_first_stop_however_the_text_is_split() -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        want, hits = text, False  # cut before the stop that completes first (the longest)
        for e in range(1, len(text) + 1):
            if ends := [len(s) for s in stops if text[:e].endswith(s)]:
                want, hits = text[: e - max(ends)], True
                break
        st, out, hit, i = StopText(stops), [], False, 0
        while i < len(text) and not hit:
            n = rng.randint(1, 3)
            piece, hit = st.push(text[i : i + n])
            out.append(piece)
            i += n
        if not hit:
            out.append(st.flush())
        assert "".join(out) == want and hit == hits, (text, stops)
