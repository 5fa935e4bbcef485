"""What servicers and clients share: a refusal with its gRPC status, wire decoding that
refuses, the error a client raises for a refused call, :class:`Rpc`, the one decorator
every servicer's methods wear (count the call by status, answer refusals and failures with a
status, never let a bad request take the daemon down), and :class:`DecodeGuard`, the server
interceptor that answers a request whose bytes do not parse (grpc itself says UNKNOWN)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
#: an exception → the status and message it is answered with, or None when not a refusal
StatusHook = Callable[[Exception], "tuple[grpc.StatusCode, str] | None"]


class StatusError(Exception):
    """A remote call refused or failed; ``code`` is its gRPC status, ``detail`` its message."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code, self.detail = code, detail


class Reject(Exception):
    """A request refused with ``code``; ``str(self)`` is the message the client sees."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def wire(fn: Callable[[], T]) -> T:
    """Run a decoding step; a WireError becomes INVALID_ARGUMENT with its message."""
    # Here, not at the top: corpusd.wire imports torch, and the CLI's clients (this module's
    # StatusError) must start without it. A caller decoding tensors has imported it already.
    from corpusd.wire import WireError

    try:
        return fn()
    except WireError as e:
        raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _no_status(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    return None


@dataclass(frozen=True, slots=True)
class Rpc:
    """How one service answers its calls; ``Rpc(...)("Method")`` decorates a servicer method
    (unary, or an async generator for a server stream).

    Every call is counted in ``requests(self).labels(method, code)`` — before its status goes
    out, so a client that sees the status can also scrape it. A :class:`Reject` is answered with
    its code and message, another exception with what ``status`` makes of it (a refusal, logged
    at info unless its code is in ``quiet``), and anything else with INTERNAL, logged with its
    traceback. ``grpc.aio.AbortError`` (the method aborted the call itself) passes through.

    Args:
        log: the service's logger.
        requests: ``self`` → the service's Counter labelled ``(method, code)``.
        status: translates the service's own exceptions to ``(code, detail)``; None: not one.
        sizes: ``self`` → ``(bytes_in, bytes_out)`` Counters labelled ``(method,)``: unary
            methods count their messages' ``ByteSize()`` there unless decorated ``sized=False``.
        quiet: refusal codes not logged (load shedding: a line per shed request adds load).
    """

    log: logging.Logger
    requests: Callable[[Any], Counter]
    status: StatusHook = _no_status
    sizes: Callable[[Any], tuple[Counter, Counter]] | None = None
    quiet: frozenset[grpc.StatusCode] = field(default_factory=frozenset)

    def __call__(self, method: str, sized: bool | None = None) -> Callable[[F], F]:
        """Decorate ``method``'s servicer function. ``sized`` (default: when ``sizes`` is
        given; unary only): count request and reply bytes (``ByteSize`` serialises the message,
        a copy of its payload: methods with tensor payloads count their tensors' bytes
        themselves)."""
        assert not sized or self.sizes is not None, f"{method}: sized needs Rpc(sizes=...)"

        def deco(fn: F) -> F:
            if inspect.isasyncgenfunction(fn):
                assert not sized, f"{method}: a stream counts its own bytes"

                @functools.wraps(fn)
                async def stream(self_: Any, request: Any, context: Any) -> AsyncIterator[Any]:
                    try:
                        async for msg in fn(self_, request, context):
                            yield msg
                    except grpc.aio.AbortError:
                        raise
                    except Exception as e:
                        await self.abort(self_, method, e, context)
                    self.requests(self_).labels(method, "OK").inc()

                return cast(F, stream)

            @functools.wraps(fn)
            async def unary(self_: Any, request: Any, context: Any) -> Any:
                count_bytes = self.sizes is not None and sized is not False
                sizes = self.sizes(self_) if count_bytes and self.sizes is not None else None
                if sizes is not None:
                    sizes[0].labels(method).inc(request.ByteSize())
                try:
                    reply = await fn(self_, request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await self.abort(self_, method, e, context)
                if sizes is not None:
                    sizes[1].labels(method).inc(reply.ByteSize())
                self.requests(self_).labels(method, "OK").inc()
                return reply

            return cast(F, unary)

        return deco

    async def abort(self, service: Any, method: str, e: Exception, context: Any) -> NoReturn:
        """Count, log and answer ``e`` as the status it maps to; always raises (AbortError).
        For streams that handle their own errors."""
        if isinstance(e, grpc.aio.AbortError):
            raise e
        if isinstance(e, Reject):
            code, detail = e.code, str(e)
        else:
            code, detail = self.status(e) or (
                grpc.StatusCode.INTERNAL,
                f"internal error in {method}: {type(e).__name__}: {e}",
            )
        if code == grpc.StatusCode.INTERNAL:
            self.log.error("%s failed", method, exc_info=e)
        elif code not in self.quiet:
            self.log.info("%s refused: %s: %s", method, code.name, detail)
        self.requests(service).labels(method, code.name).inc()
        await context.abort(code, detail)
        raise AssertionError("context.abort returned")  # it raises AbortError


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT, naming the message type and what is wrong, to a call of a
    corpusd service (``/corpusd.v1.*``) whose request bytes do not parse (truncated, a bad
    varint, invalid UTF-8 in a string field): grpc would answer UNKNOWN with the parser's
    exception. Such a request never reaches the servicer. Other services (health) pass as they
    are."""

    PREFIX = "/corpusd.v1."

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = getattr(details, "method", "")
        if handler is None or not method.startswith(self.PREFIX) or handler.request_streaming:
            return handler
        parse = handler.request_deserializer
        assert parse is not None, f"{method}: no request deserializer"

        def decode(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as e:
                return _Undecodable(f"request is not a valid message for {method}: {e}")

        unary, stream = handler.unary_unary, handler.unary_stream
        if unary is not None:

            async def unary_guarded(request: Any, context: Any) -> Any:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
                return await unary(request, context)

            return handler._replace(request_deserializer=decode, unary_unary=unary_guarded)
        assert stream is not None, f"{method}: neither unary nor server-streaming"

        async def stream_guarded(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
            async for reply in stream(request, context):
                yield reply

        return handler._replace(request_deserializer=decode, unary_stream=stream_guarded)


@dataclass(frozen=True, slots=True)
class _Undecodable:
    detail: str
