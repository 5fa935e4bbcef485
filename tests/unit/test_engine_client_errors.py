"""``corpusd pin --engine``'s HTTP client says which way a call got no answer
(``corpusd/engine/client.py``): nothing listening (unreachable), the server gone mid-call (an
SGLang scheduler that died on a kernel assertion during the prefill closed the connection, which
the pin called "unreachable"), no answer in time. Real loopback sockets, CPU."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from corpusd.engine.client import Engine, EngineError


def _server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A one-connection-at-a-time TCP server on loopback running ``handle`` on each accept."""
    ls = socket.create_server(("127.0.0.1", 0))
    ls.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = ls.accept()
            except TimeoutError:
                continue
            with conn:
                handle(conn)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{ls.getsockname()[1]}"
    stop.set()
    t.join()
    ls.close()


def _read_request(conn: socket.socket) -> None:
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)


@pytest.fixture
def dies_mid_call() -> Iterator[str]:
    yield from _server(_read_request)  # reads the request, then closes without a status line


@pytest.fixture
def silent() -> Iterator[str]:
    def wait(conn: socket.socket) -> None:
        _read_request(conn)
        threading.Event().wait(1.0)

    yield from _server(wait)


def test_a_server_that_closes_mid_call_is_not_called_unreachable(dies_mid_call: str) -> None:
    with pytest.raises(EngineError) as e:
        Engine(dies_mid_call).generate([1, 2, 3], 4, timeout=5)
    msg = str(e.value)
    assert "closed the connection during /generate without an answer" in msg, msg
    assert "its log says why" in msg and "unreachable" not in msg


def test_nothing_listening_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(EngineError, match=rf"engine http://127.0.0.1:{port} is unreachable"):
            Engine(f"http://127.0.0.1:{port}").server_info()


def test_no_answer_in_time_says_the_limit(silent: str) -> None:
    with pytest.raises(EngineError, match=r"/server_info did not answer within 0.3 s"):
        Engine(silent, timeout=0.3).server_info()
