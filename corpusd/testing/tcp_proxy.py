"""A TCP proxy on loopback for tests and the soak (tools/soak.py): put it in front of a daemon
(a holder's ``--advertise``, ``up --coordinator-advertise``) and delay, partition or reset the
link as a network would. A plain relay, so TLS passes through it end to end."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections import Counter


class Proxy:
    """A TCP proxy on loopback (port ``listen``; 0: a free one) to ``target`` in a thread: ``mode``
    pass, delay (each chunk waits ``delay_s``), drop (a partition: nothing passes until it
    heals) or reset (every connection is closed with RST, and new ones as they come). A plain
    relay: TLS goes through it end to end (the certificates name 127.0.0.1 on both sides)."""

    def __init__(self, target: str, listen: int = 0) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.mode, self.delay_s = "pass", 0.0
        self.conns: set[asyncio.StreamWriter] = set()
        self.accepted = 0  # connections taken, whatever became of them
        self.upstream_errors: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.Server
        ready = threading.Event()
        self.address = ""

        def run() -> None:
            asyncio.set_event_loop(self.loop)

            async def start() -> None:
                srv = self.server = await asyncio.start_server(self._conn, "127.0.0.1", listen)
                self.address = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
                ready.set()

            self.loop.run_until_complete(start())
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        if not ready.wait(10):
            raise RuntimeError(f"a proxy to {target} could not listen on port {listen}")

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode == "reset":
            self.loop.call_soon_threadsafe(self._reset_all)

    def close(self) -> None:
        """Stop listening and reset every connection; the proxy's thread ends."""
        self.mode = "reset"

        def stop() -> None:
            self._reset_all()
            self.server.close()
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)

    def _reset_all(self) -> None:
        for w in list(self.conns):
            _rst(w)
        self.conns.clear()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode == "reset":
            _rst(w)
            return
        while self.mode == "drop":  # a partition: nothing gets through until it heals
            await asyncio.sleep(0.05)
        try:
            ur, uw = await asyncio.open_connection(self.host, self.port)
        except OSError as e:  # the client sees its connection closed: counted, to explain it
            self.upstream_errors[f"{type(e).__name__}: {e}"[:200]] += 1
            w.close()
            return
        self.conns |= {w, uw}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if self.mode == "delay":
                        await asyncio.sleep(self.delay_s)
                    while self.mode == "drop":  # held, as TCP retransmits across a partition
                        await asyncio.sleep(0.05)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pump(r, uw), pump(ur, w))
        self.conns -= {w, uw}


def _rst(w: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP reset (SO_LINGER 0), as a middlebox or a crash does."""
    with contextlib.suppress(OSError):
        w.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
    w.transport.abort()
