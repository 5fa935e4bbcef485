"""``tools/bench_share.py``'s load generator: the trial's clients in threads of the bench's
process or dealt over processes, against stand-in SGLang servers (``tools/bench_client_cap``)
that stream every token at once and count them as SGLang does."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tools.bench_client_cap import FakeGenerate
from tools.bench_share import client_procs, trial


@pytest.fixture
def servers() -> Iterator[list[FakeGenerate]]:
    got = [FakeGenerate() for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in got]
    for t in threads:
        t.start()
    yield got
    for s, t in zip(got, threads, strict=True):
        s.shutdown()
        s.server_close()
        t.join()


@pytest.mark.parametrize("procs", [1, 2])
def test_every_session_streams_its_tokens_and_the_servers_count_them(
    servers: list[FakeGenerate], procs: int
) -> None:
    got = trial(servers, "stock", "", [[1, 2, 3], [4, 5]], 3, 12, 2, procs)
    assert got["sessions"] == 2 * 3 * 2 and got["errors"] == 0, got["error_examples"]
    assert got["client_tokens"] == got["server_tokens"] == 12 * 12
    assert [s.tokens for s in servers] == [6 * 12, 6 * 12]  # client w on server w mod 2
    assert got["client_procs"] == procs and got["client_cpu_s"] > 0
    assert got["client_busy_max"] > 0 and got["wall_s"] > 0
    assert got["sessions_held_max"] >= 0 and got["itl_client_p50_ms"] >= 0


def test_more_processes_than_clients_are_not_started(servers: list[FakeGenerate]) -> None:
    got = trial(servers, "stock", "", [[7]], 1, 4, 1, 8)
    assert got["client_procs"] == 2 and got["sessions"] == 2 and got["errors"] == 0


def test_the_default_is_two_processes_a_worker_and_at_most_half_the_cores(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert client_procs(0, 4) == 8 and client_procs(3, 4) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert client_procs(0, 4) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert client_procs(0, 4) == 1
