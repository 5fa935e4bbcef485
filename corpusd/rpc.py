"""What servicers and clients share: a refusal with its gRPC status, wire decoding that
refuses, and the error a client raises for a refused call."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from corpusd.wire import WireError

T = TypeVar("T")


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
    try:
        return fn()
    except WireError as e:
        raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
