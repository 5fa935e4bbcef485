"""The agent worker's OpenAI-compatible HTTP API (``corpusd agent --http-port``): Starlette on
uvicorn, in the agent's own event loop, on its own sessions and scheduler, so a request's tokens
are the ones the gRPC API gives for the same prompt and parameters.

``GET /v1/models`` lists the pinned corpora; ``POST /v1/completions`` and
``POST /v1/chat/completions`` answer over one of them (named as the model), whole or streamed
as server-sent events. Each request opens a session, generates and closes it — a client that
goes away mid-stream closes it too. Refusals are OpenAI's ``{"error": {...}}`` with the HTTP
status a client's library expects (``requester/openai_api.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from corpusd.coordinator.client import CoordinatorError
from corpusd.rpc import Reject
from requester.agent import AgentService
from requester.corpus_view import CorpusUnavailable
from requester.openai_api import (
    DEEPSEEK_ASSISTANT,
    DEEPSEEK_USER,
    ApiError,
    StopText,
    TextRequest,
    chat_text,
    parse,
    usage,
)

log = logging.getLogger("corpusd.http")
Code = grpc.StatusCode
MAX_BODY = 8 << 20  # bytes of one request body
#: a refusal's gRPC status → its HTTP status
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.FAILED_PRECONDITION: 400,
    Code.NOT_FOUND: 404,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.CANCELLED: 499,
}
#: the request parameter a refusal's message starts with → the parameter OpenAI names
PARAMS = ("max_tokens", "temperature", "top_p", "stop_token_ids", "prompt")


def api_error(e: Exception, param: str | None = None) -> ApiError:
    """What an exception of the agent becomes over HTTP (Reject: by its status; a coordinator
    or holder that failed: 503; anything else: 500, logged)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Reject):
        status = HTTP_STATUS.get(e.code, 500)
        head = str(e).split(":", 1)[0]
        code = "model_not_found" if e.code == Code.NOT_FOUND else e.code.name.lower()
        named = head if head in PARAMS else param
        if head == "prompt" and param:  # a chat's prompt is its messages
            named = param
        return ApiError(status, str(e), named, code)
    if isinstance(e, (CoordinatorError, CorpusUnavailable, grpc.aio.AioRpcError)):
        return ApiError(503, f"unavailable: {e}", None, "unavailable")
    log.error("HTTP request failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")


def _json(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenAIApi:
    """The routes over one :class:`AgentService`."""

    def __init__(self, svc: AgentService) -> None:
        self.svc = svc
        tok = svc.tok
        # DeepSeek's chat markers when the tokenizer has them as single tokens
        self.deepseek = all(len(tok.encode(m)) == 1 for m in (DEEPSEEK_USER, DEEPSEEK_ASSISTANT))
        self.http = svc.metrics.counter("http_requests", "HTTP API requests", ["path", "status"])
        #: the coordinator's last model list and when it was read (unix s)
        self.last_models: tuple[list[dict[str, Any]], float] | None = None

    def app(self) -> Starlette:
        async def refuse(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            e = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
            self.http.labels(request.url.path, str(exc.status_code)).inc()
            return _json(e)

        return Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ],
            exception_handlers={HTTPException: refuse},
        )

    async def models(self, request: Request) -> Response:
        """Pinned corpora (ready, and pinned for this agent's model) as OpenAI models; without a
        coordinator, the corpora this worker has bound. While the coordinator is unavailable
        (chat on bound corpora still works) the last list it gave is served, or else the
        bound corpora, marked stale: a ``corpusd_stale`` field and the ``X-Corpusd-Stale``
        header say since when and why."""
        svc, data = self.svc, []
        try:
            if svc.coordinator is not None:
                fp = svc.fingerprint
                for c in await svc.coordinator.list_corpora():
                    if c.state == "ready" and (not fp or c.model_fingerprint in ("", fp)):
                        data.append(
                            _model(c.name or c.corpus_id, c.corpus_id, c.tokens, c.created_at)
                        )
                self.last_models = (data, time.time())
            else:
                data = self._bound()
        except CoordinatorError as e:
            if e.code != Code.UNAVAILABLE:
                return self._refused("/v1/models", api_error(e))
            return self._stale(str(e))
        except Exception as e:
            return self._refused("/v1/models", api_error(e))
        self.http.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": data})

    def _bound(self) -> list[dict[str, Any]]:
        return [_model(cid, cid, b.view.token_count) for cid, b in self.svc.worker.corpora.items()]

    def _stale(self, why: str) -> Response:
        """The last known model list (else the bound corpora), said to be stale; 503 when
        there is neither."""
        if self.last_models is not None:
            data, at = self.last_models
            since = (
                f"the coordinator's list of {datetime.fromtimestamp(at).isoformat('T', 'seconds')}"
            )
        else:
            data, since = self._bound(), "the corpora this worker has bound"
        if not data and self.last_models is None:
            return self._refused("/v1/models", api_error(CoordinatorError(Code.UNAVAILABLE, why)))
        note = f"coordinator unavailable ({why}); serving {since}"
        self.http.labels("/v1/models", "200").inc()
        log.info("/v1/models: %s", note)
        return JSONResponse(
            {"object": "list", "data": data, "corpusd_stale": note},
            headers={
                "X-Corpusd-Stale": " ".join(note.split()).encode("ascii", "replace")[:400].decode()
            },
        )

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    def _refused(self, path: str, e: ApiError) -> Response:
        self.http.labels(path, str(e.status)).inc()
        if e.status < 500:
            log.info("%s refused: %d %s", path, e.status, e)
        return _json(e)

    async def _answer(self, request: Request, chat: bool) -> Response:
        path = request.url.path
        try:
            req = parse(await _body(request), chat)
            svc = self.svc
            await _or_param(svc.corpus(req.corpus), "model")
            svc.params(  # checked here, before the response starts (pieces makes them again)
                req.max_tokens, req.temperature, req.top_p, req.stop_token_ids, req.seed
            )
            text = chat_text(req.messages, self.deepseek) if chat else req.prompt
            where = "messages" if chat else "prompt"
            try:
                prompt = svc.encode(text) if isinstance(text, str) else text
            except Exception as e:
                raise api_error(e, where) from None
            session, _ = await _or_param(svc.open_session(req.corpus, prompt), where)
        except Exception as e:
            return self._refused(path, api_error(e))
        self.http.labels(path, "200").inc()
        reply = _Reply(req, prompt, svc, session.id)
        if req.stream:
            return StreamingResponse(
                reply.events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(reply.close),
            )
        try:
            return JSONResponse(await reply.whole())
        except Exception as e:
            return _json(api_error(e))
        finally:
            reply.close()


async def _or_param(awaitable: Any, param: str) -> Any:
    """``await awaitable``; a refusal that names no parameter is put on ``param``."""
    try:
        return await awaitable
    except Exception as e:
        err = api_error(e, param)
        raise err from None


async def _body(request: Request) -> Any:
    """The request's JSON, read up to MAX_BODY bytes. Raises ApiError 400 / 413."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY >> 20} MiB", None, "body_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not JSON: {e}", None, "invalid_json") from None


def _model(name: str, corpus_id: str, tokens: int, created_at: str = "") -> dict[str, Any]:
    """A corpus as an OpenAI model object (``created``: when its pages were made, unix s)."""
    created = 0
    with contextlib.suppress(ValueError):
        created = int(datetime.fromisoformat(created_at).timestamp()) if created_at else 0
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "corpusd",
        "corpus_id": corpus_id,
        "corpus_tokens": tokens,
    }


class _Reply:
    """One request's answer: the session's tokens as OpenAI objects, whole or as events."""

    def __init__(self, req: TextRequest, prompt: list[int], svc: AgentService, sid: str) -> None:
        self.req, self.prompt, self.svc, self.sid = req, prompt, svc, sid
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.finish = ""

    def close(self) -> None:
        """Close the session (once; it may be gone already)."""
        with contextlib.suppress(Reject):
            self.svc.close_session(self.sid)

    async def pieces(self) -> AsyncIterator[tuple[list[int], str]]:
        """``(new token ids, new text)`` as generated, with stop strings applied; sets
        ``finish``."""
        r = self.req
        params = self.svc.params(r.max_tokens, r.temperature, r.top_p, r.stop_token_ids, r.seed)
        stop = StopText(r.stop)
        async with contextlib.aclosing(self.svc.generate(self.sid, params)) as tokens:
            async for tok, text, finish in tokens:
                self.tokens.append(tok)
                out, hit = stop.push(text)
                if hit:  # the rest is not generated
                    self.finish = "stop"
                    yield [tok], out
                    return
                if finish:
                    self.finish = finish
                    out += stop.flush()
                yield [tok], out

    def _choice(self, text: str, ids: list[int], finish: str | None, first: bool) -> dict:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.req.chat and not self.req.stream:
            c["message"] = {"role": "assistant", "content": text}
        elif self.req.chat:
            c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish and not text:
                c["delta"] = {}
        else:
            c["text"] = text
        if self.req.return_token_ids:
            c["token_ids"] = ids
            if first:
                c["prompt_token_ids"] = self.prompt
        return c

    def _object(self, choices: list[dict[str, Any]], whole: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.req.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind if whole or not self.req.chat else "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }

    async def whole(self) -> dict[str, Any]:
        texts = [text async for _, text in self.pieces()]
        obj = self._object([self._choice("".join(texts), self.tokens, self.finish, True)], True)
        obj["usage"] = usage(len(self.prompt), len(self.tokens))
        return obj

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token (the last with ``finish_reason``), a usage
        chunk when asked, ``[DONE]``; a failure after the start is an ``error`` event."""
        first = True
        try:
            async for ids, text in self.pieces():
                finish = self.finish or None
                yield _sse(self._object([self._choice(text, ids, finish, first)], False))
                first = False
            if self.req.include_usage:
                obj = self._object([], False)
                obj["usage"] = usage(len(self.prompt), len(self.tokens))
                yield _sse(obj)
            yield "data: [DONE]\n\n"
        except Exception as e:
            yield _sse(api_error(e).body())
        finally:
            self.close()


class _Server(uvicorn.Server):
    """uvicorn inside the agent's loop: the agent owns SIGTERM/SIGINT and the drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def bind(host: str, port: int) -> socket.socket:
    """The HTTP API's listening socket (``port`` 0: any free one). Raises PortInUse."""
    from corpusd.daemon import PortInUse

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        msg = f"--http-port {port}: cannot listen on {host}:{port} ({e.strerror})"
        raise PortInUse(msg) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bearer_guard(app: Any, tokens: dict[str, str]) -> Any:
    """ASGI middleware: an HTTP request must carry ``Authorization: Bearer TOKEN`` with a token
    of the agent (or admin) right, as the agent's gRPC port asks (OpenAI clients send their
    ``api_key`` so). Missing or unknown: 401; another right: 403; OpenAI-style JSON errors."""

    from corpusd.auth import TokenAuth  # one constant-time token check for gRPC and HTTP

    check = TokenAuth(tokens)

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if auth[:7].lower() == b"bearer ":  # the scheme is case-insensitive in HTTP
                auth = b"Bearer " + auth[7:]
            right = check.right([("authorization", auth)])
            if right not in ("agent", "admin"):
                status, code, msg = (
                    (401, "invalid_api_key", "missing or unknown bearer token")
                    if right is None
                    else (403, "permission_denied", f"a {right} token may not use the agent API")
                )
                err = {"message": msg, "type": "invalid_request_error", "param": None}
                body = json.dumps({"error": {**err, "code": code}}).encode()
                headers = [(b"content-type", b"application/json")]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


class HttpApi:
    """The running HTTP API: ``start`` it in the agent's loop, ``stop`` it on drain."""

    def __init__(
        self,
        svc: AgentService,
        sock: socket.socket,
        drain_s: float,
        tls: dict[str, Any] | None = None,
        tokens: dict[str, str] | None = None,
    ) -> None:
        self.sock, self.port = sock, sock.getsockname()[1]
        app = OpenAIApi(svc).app()
        config = uvicorn.Config(
            bearer_guard(app, tokens) if tokens else app,
            **(tls or {}),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(int(drain_s), 1),
        )
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

    def stop_accepting(self) -> None:
        self.server.should_exit = True

    async def stopped(self, timeout: float) -> None:
        if self.task is None:
            return
        self.stop_accepting()
        try:
            await asyncio.wait_for(self.task, timeout + 1)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.task.cancel()
