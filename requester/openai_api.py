"""The OpenAI-compatible API's requests and replies, as plain data: a request body checked into
a :class:`TextRequest`, a chat rendered into prompt text, stop strings applied to streamed
text, errors in OpenAI's shape. No HTTP here (``requester/http.py`` serves it) and no torch.

The corpus is the model: ``"model": "sample-repo"`` (a corpus id, name or id prefix of ≥ 8
characters), or ``"corpus"`` (an extra field) when a framework insists on its own model name.
Every request opens a session on the corpus, generates, and closes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``{"error": {...}}`` types by HTTP status, as OpenAI names them
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # stop strings, at most (OpenAI's limit)


class ApiError(Exception):
    """A refused request: ``status`` (HTTP), the message, the parameter at fault and a code."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error object."""
        return {
            "error": {
                "message": str(self),
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param, code)


@dataclass(frozen=True, slots=True)
class TextRequest:
    """A checked ``/v1/completions`` or ``/v1/chat/completions`` body. ``prompt`` is text or
    token ids (completions only); ``max_tokens`` 0 = the agent's default."""

    model: str  # as the caller named it (echoed back)
    corpus: str  # what is resolved: ``corpus`` if given, else ``model``
    prompt: str | list[int]
    chat: bool
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    messages: tuple[tuple[str, str], ...] = field(default=(), repr=False)


def _typed(body: Mapping[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    """``body[key]`` when present and not null, checked to be one of ``kinds``; else None."""
    v = body.get(key)
    if v is None:
        return None
    if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
        raise bad(key, f"must be {what}, got {type(v).__name__}", "invalid_type")
    return v


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    v = _typed(body, key, (int, float), "a number")
    if v is None:
        return default
    if not math.isfinite(v):
        raise bad(key, f"{v}; must be finite")
    return float(v)


def _neutral(body: Mapping[str, Any], chat: bool) -> None:
    """Refuse, by name, what is asked but not served (rather than silently ignore it)."""
    if _typed(body, "n", (int,), "an integer") not in (None, 1):
        raise ApiError(400, "n: only 1 completion per request is served", "n", "unsupported")
    if _typed(body, "best_of", (int,), "an integer") not in (None, 1):
        raise ApiError(400, "best_of: only 1 is served", "best_of", "unsupported")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0) != 0.0:
            raise ApiError(400, f"{key}: penalties are not served; give 0", key, "unsupported")
    neutral_false = ["echo"] if not chat else ["logprobs"]
    for key in neutral_false:
        if _typed(body, key, (bool,), "a boolean"):
            raise ApiError(400, f"{key}: not served", key, "unsupported")
    if not chat and body.get("logprobs") is not None:
        raise ApiError(400, "logprobs: not served", "logprobs", "unsupported")
    for key in ("logit_bias", "suffix", "top_logprobs", "tools", "functions"):
        if body.get(key) not in (None, {}, [], ""):
            raise ApiError(400, f"{key}: not served", key, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(
            400, "response_format: only text is served", "response_format", "unsupported"
        )


def _messages(body: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty array of {role, content}", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content", "invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{role!r}; one of {', '.join(ROLES)}")
        if content is None:
            content = ""
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise bad(f"{where}.content[{j}]", "only text parts are served", "unsupported")
                if not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}].text", "must be a string", "invalid_type")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or text parts", "invalid_type")
        out.append((role, content))
    return tuple(out)


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "required", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    if isinstance(p, list) and all(isinstance(t, (str, list)) for t in p):
        raise ApiError(400, "prompt: one prompt per request is served", "prompt", "unsupported")
    raise bad("prompt", "must be a string or an array of token ids", "invalid_type")


def parse(body: Any, chat: bool) -> TextRequest:
    """A request body (parsed JSON) → :class:`TextRequest`. Raises ApiError 400 naming the
    parameter: a missing or mistyped field, a value out of range, a feature not served. Range
    checks that depend on the agent (``max_tokens`` against ``--max-new-tokens``, the prompt's
    length) are the agent's (``AgentService.params`` / ``open_session``)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_body")
    model = _typed(body, "model", (str,), "a string") or ""
    corpus = _typed(body, "corpus", (str,), "a string") or model
    if not corpus:
        raise bad("model", "required: the corpus to answer over (its name or id)",
                  "missing_required_parameter")  # fmt: skip
    _neutral(body, chat)
    messages = _messages(body) if chat else ()
    prompt: str | list[int] = "" if chat else _prompt(body)
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = 0
    for key in keys:
        v = _typed(body, key, (int,), "an integer")
        if v is not None and v <= 0:
            raise bad(key, f"{v}; must be >= 1")
        if v is not None:
            max_tokens = v
            break
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", "must be a non-empty string or an array of them", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"{len(stops)} strings; at most {MAX_STOP}")
    ids = body.get("stop_token_ids") or []
    if not (isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)):
        raise bad("stop_token_ids", "must be an array of token ids (>= 0)", "invalid_type")
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 1 << 63:
        raise bad("seed", f"{seed}; must be in [0, 2^63)")
    opts = _typed(body, "stream_options", (dict,), "an object") or {}
    return TextRequest(
        model=model or corpus,
        corpus=corpus,
        prompt=prompt,
        chat=chat,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        seed=seed or 0,
        stop=tuple(stops),
        stop_token_ids=tuple(ids),
        stream=bool(_typed(body, "stream", (bool,), "a boolean")),
        include_usage=bool(opts.get("include_usage")),
        return_token_ids=bool(_typed(body, "return_token_ids", (bool,), "a boolean")),
        messages=messages,
    )


#: DeepSeek V3.x's chat markers; used when the tokenizer has them as single tokens
DEEPSEEK_USER, DEEPSEEK_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"


def chat_text(messages: Sequence[tuple[str, str]], deepseek: bool) -> str:
    """The prompt a chat becomes after the corpus. ``deepseek``: DeepSeek V3.2's non-thinking
    template (system text, then ``<｜User｜>…<｜Assistant｜></think>…<｜end▁of▁sentence｜>`` turns,
    ending ``<｜Assistant｜></think>``); else a plain one, which the byte-level tiny model reads:
    ``"\\n\\nUser: …\\nAssistant: …\\nAssistant:"`` (system and developer turns as ``System:``,
    tool results as ``Tool:``)."""
    if deepseek:
        parts = []
        for role, content in messages:
            if role in ("system", "developer"):
                parts.append(content)
            elif role == "assistant":
                parts.append(f"{DEEPSEEK_ASSISTANT}</think>{content}{DEEPSEEK_EOS}")
            else:
                parts.append(f"{DEEPSEEK_USER}{content}")
        return "".join(parts) + f"{DEEPSEEK_ASSISTANT}</think>"
    names = {"system": "System", "developer": "System", "user": "User", "tool": "Tool"}
    lines = [f"{names.get(role, 'Assistant')}: {content}" for role, content in messages]
    return "\n\n" + "\n".join(lines) + "\nAssistant:"


class StopText:
    """Applies stop strings to streamed text: ``push`` returns the text safe to send (a tail
    that may begin a stop string is held back) and whether a stop string was met; the answer is
    cut before the stop string that completes first (the longest, if several end at one
    character), whatever pieces the text comes in. ``flush`` returns what is held back once
    generation ends."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.held = tuple(stops), ""
        self.keep = max((len(s) for s in stops), default=1) - 1

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        out = []
        for ch in text:
            self.held += ch
            ends = [len(s) for s in self.stops if self.held.endswith(s)]
            if ends:
                out.append(self.held[: len(self.held) - max(ends)])
                self.held = ""
                return "".join(out), True
            if len(self.held) > self.keep:
                out.append(self.held[0])
                self.held = self.held[1:]
        return "".join(out), False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
