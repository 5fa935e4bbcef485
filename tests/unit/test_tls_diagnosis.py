"""The TLS probe behind "TLS handshake failed: …" (issue 37), against real local sockets: a
peer that answers a ClientHello with bytes that are not TLS serves plaintext; one that closes
or resets the connection, or accepts it and says nothing, is a daemon restarting or stopped,
not a client that should drop its certificates (the soak saw "serves plaintext (started
--insecure?)" for an agent killed mid-handshake)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from corpusd import local_ca, security, tls_diagnosis
from corpusd.tls_diagnosis import explain, probe

SETTINGS = bytes(3) + b"\x04" + bytes(5)  # an empty HTTP/2 SETTINGS frame
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DETAIL = "failed to connect to all addresses; last error: Handshake read failed (Socket closed)"


@contextmanager
def server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback listener whose every connection is given to ``handle`` in a thread."""
    ls = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    try:
        yield f"127.0.0.1:{ls.getsockname()[1]}"
    finally:
        ls.close()
        for c in held:
            c.close()


def plaintext_h2(conn: socket.socket) -> None:
    """A plaintext gRPC server: its SETTINGS whatever comes (the ClientHello included)."""
    conn.recv(4096)
    conn.sendall(SETTINGS)
    conn.close()


def close_on_hello_plaintext_h2(conn: socket.socket) -> None:
    """Plaintext HTTP/2 that closes without a word on a ClientHello, and answers the preface."""
    got = conn.recv(4096)
    if got.startswith(H2_PREFACE[:4]):
        conn.sendall(SETTINGS)
    conn.close()


def close(conn: socket.socket) -> None:
    conn.recv(4096)
    conn.close()


def reset(conn: socket.socket) -> None:
    conn.recv(4096)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()  # RST


def silent(conn: socket.socket) -> None:
    conn.recv(4096)  # and nothing more: a SIGSTOPped daemon's kernel still accepts


@pytest.fixture
def tls_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> security.Identity:
    monkeypatch.setenv("CORPUSD_HOME", str(tmp_path / "home"))  # no running up's CA is found
    monkeypatch.setattr(tls_diagnosis, "PROBE_S", 0.5)
    ca = local_ca.ensure(tmp_path / "tls")
    return security.identity_from(str(ca.ca), str(ca.cert), str(ca.key), "")


@pytest.mark.parametrize("handle", [plaintext_h2, close_on_hello_plaintext_h2])
def test_a_plaintext_server_is_named(handle: Callable, tls_client: security.Identity) -> None:
    with server(handle) as address:
        assert probe(address) == "plaintext"
        line = explain(address, DETAIL, tls_client)
    assert "serves plaintext" in line and "\n" not in line, line


@pytest.mark.parametrize("handle", [close, reset])
def test_a_closed_handshake_is_not_plaintext(
    handle: Callable, tls_client: security.Identity
) -> None:
    with server(handle) as address:
        assert probe(address) == "closed"
        line = explain(address, DETAIL, tls_client)
    assert "closed during the TLS handshake (restarting?)" in line, line
    assert "plaintext (" not in line and "--insecure" not in line and "\n" not in line, line


def test_a_silent_server_is_stopped_not_plaintext(tls_client: security.Identity) -> None:
    with server(silent) as address:
        assert probe(address) == "silent"
        line = explain(address, DETAIL, tls_client)
    assert "did not answer the TLS handshake" in line and "plaintext" not in line, line


def test_nothing_listening_is_down(tls_client: security.Identity) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        address = f"127.0.0.1:{s.getsockname()[1]}"
    assert probe(address) == "down"
    assert explain(address, DETAIL, tls_client) == DETAIL
