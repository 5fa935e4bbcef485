"""Bearer tokens and their rights: the tokens file, and :class:`TokenAuth`, the server interceptor
that answers a corpusd call without a known token UNAUTHENTICATED and one whose token lacks the
method's right PERMISSION_DENIED.

Three rights: ``admin`` (pin, unpin, rm, and everything else: the operator), ``agent`` (sessions,
Attend, route and fetch from holders, page tables) and ``holder`` (register and heartbeat with
the coordinator). A tokens file has one ``RIGHT TOKEN`` per line; ``#`` starts a comment.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

RIGHTS = ("admin", "agent", "holder")
_ANY = frozenset(RIGHTS)
_AGENT = frozenset({"admin", "agent"})
_HOLDER = frozenset({"admin", "holder"})
_ADMIN = frozenset({"admin"})
#: full method name → the rights that may call it. A corpusd method not named here needs
#: admin (fail closed); services outside corpusd (grpc.health) need no token.
METHODS: Mapping[str, frozenset[str]] = {
    "/corpusd.v1.Coordinator/RegisterHolder": _HOLDER,
    "/corpusd.v1.Coordinator/Heartbeat": _HOLDER,
    "/corpusd.v1.Coordinator/ListCorpora": _ANY,
    "/corpusd.v1.Coordinator/GetPageTable": _ANY,
    "/corpusd.v1.Coordinator/ListHolders": _ANY,
    "/corpusd.v1.Coordinator/ListWorkers": _ANY,
    "/corpusd.v1.Coordinator/ReportWorker": _AGENT,
    "/corpusd.v1.Coordinator/ChooseWorker": _AGENT,
    "/corpusd.v1.Coordinator/Pin": _ADMIN,
    "/corpusd.v1.Coordinator/Unpin": _ADMIN,
    "/corpusd.v1.Coordinator/Delete": _ADMIN,
    "/corpusd.v1.Holder/Attend": _AGENT,
    "/corpusd.v1.Holder/Fetch": _AGENT,
    "/corpusd.v1.Holder/IndexTopK": _AGENT,
    "/corpusd.v1.Holder/IndexKeys": _AGENT,
    "/corpusd.v1.Holder/SharePool": _AGENT,
    "/corpusd.v1.Holder/Info": _ANY,
    "/corpusd.v1.Holder/Assign": _ADMIN,
    "/corpusd.v1.Holder/Release": _ADMIN,
    "/corpusd.v1.Transport/Join": _AGENT,
    "/corpusd.v1.Transport/OpenStream": _AGENT,
    "/corpusd.v1.Agent/OpenSession": _AGENT,
    "/corpusd.v1.Agent/Generate": _AGENT,
    "/corpusd.v1.Agent/CloseSession": _AGENT,
    "/corpusd.v1.Agent/Attend": _AGENT,
}
_MIN_TOKEN = 16  # characters: a guessable token is no token


class TokenError(ValueError):
    """A tokens file or a token that cannot be used; the message names the line."""


def new_token() -> str:
    """A fresh random bearer token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def check_token(token: str, where: str) -> str:
    """``token`` stripped; raises TokenError unless it is ≥ 16 printable non-space ASCII
    characters (it travels in an HTTP/2 header)."""
    t = token.strip()
    if len(t) < _MIN_TOKEN:
        raise TokenError(f"{where}: a token must be at least {_MIN_TOKEN} characters")
    if not all(33 <= ord(c) < 127 for c in t):
        raise TokenError(f"{where}: a token must be printable ASCII without spaces")
    return t


def parse_tokens(text: str, where: str = "tokens") -> dict[str, str]:
    """``RIGHT TOKEN`` lines → token → right. Raises TokenError naming the line for an unknown
    right, a malformed line, a short token or a token given twice."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenError(f"{where}:{n}: expected 'RIGHT TOKEN', got {len(parts)} fields")
        right, token = parts
        if right not in RIGHTS:
            raise TokenError(f"{where}:{n}: unknown right {right!r} (one of {', '.join(RIGHTS)})")
        token = check_token(token, f"{where}:{n}")
        if token in out:
            raise TokenError(f"{where}:{n}: this token is already given on an earlier line")
        out[token] = right
    if not out:
        raise TokenError(f"{where}: no tokens")
    return out


def load_tokens(path: str | Path) -> dict[str, str]:
    """Parse a tokens file (see :func:`parse_tokens`); refuses one others may read, since
    anyone who reads it holds every right in it."""
    p = Path(path)
    try:
        text, mode = p.read_text(), p.stat().st_mode
    except OSError as e:
        raise TokenError(f"{p}: {e.strerror}") from None
    if mode & 0o077:
        raise TokenError(f"{p}: mode {mode & 0o777:o} lets others read it; chmod 600 {p}")
    return parse_tokens(text, str(p))


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` created with mode 0600 (never readable by others, not even
    for a moment); replaces an existing file atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Checks the ``authorization: Bearer TOKEN`` metadata of every corpusd call against
    ``tokens`` (token → right) and :data:`METHODS`. A refused call never reaches the servicer;
    the comparison is constant-time over every known token."""

    PREFIX = "/corpusd.v1."

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = [(t.encode(), r) for t, r in tokens.items()]

    def right(self, metadata: Any) -> str | None:
        """The right of the call's bearer token, None when it has none or an unknown one."""
        got = b""
        for key, value in metadata or ():
            if key == "authorization":
                v = value if isinstance(value, str) else value.decode("latin-1")
                if v.startswith("Bearer "):
                    got = v[len("Bearer ") :].strip().encode("latin-1", "replace")
        found = None
        for token, right in self._tokens:  # no early exit: the time says nothing
            if hmac.compare_digest(token, got):
                found = right
        return found if got else None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = getattr(details, "method", "")
        if handler is None or not method.startswith(self.PREFIX):
            return handler
        right = self.right(getattr(details, "invocation_metadata", None))
        if right is None:
            code, why = grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a valid bearer token"
        elif right not in METHODS.get(method, _ADMIN):
            needs = " or ".join(sorted(METHODS.get(method, _ADMIN)))
            code, why = grpc.StatusCode.PERMISSION_DENIED, f"{method} needs {needs}, not {right}"
        else:
            return handler
        return _refusing(handler, code, why)


def _refusing(handler: Any, code: grpc.StatusCode, why: str) -> Any:
    """``handler`` with its behaviour replaced by answering ``code`` (same call shape)."""

    async def unary(request: Any, context: Any) -> Any:
        await context.abort(code, why)

    async def stream(request: Any, context: Any) -> Any:
        await context.abort(code, why)
        yield  # pragma: no cover  (makes this an async generator)

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=stream)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary)
    return handler._replace(stream_stream=stream)
