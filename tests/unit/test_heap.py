"""corpusd.heap: glibc's heap as every daemon's /metrics shows it, and the trimming thread."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from corpusd import heap

pytestmark = pytest.mark.skipif(heap.heap() is None, reason="needs glibc's mallinfo2 (>= 2.33)")


def test_in_use_counts_a_live_block_and_drops_when_it_is_freed() -> None:
    h0 = heap.heap()
    block = bytearray(64 << 20)  # mmapped, or from free heap glibc kept (CI: 584 MB of it)
    h1 = heap.heap()
    del block
    h2 = heap.heap()
    assert h0 is not None and h1 is not None and h2 is not None
    assert h1.in_use - h0.in_use >= 64 << 20
    assert h1.in_use - h2.in_use >= 64 << 20


def test_the_collector_serves_in_use_free_and_mmapped() -> None:
    reg = CollectorRegistry()
    reg.register(heap.HeapCollector())
    text = generate_latest(reg).decode()
    for state in ("in_use", "free", "mmapped"):
        assert f'corpusd_heap_bytes{{state="{state}"}}' in text, text


def test_trimming_starts_once_a_process_and_not_at_zero() -> None:
    assert heap.start_trimming(0) is None
    t = heap.start_trimming(3600)
    assert t is not None and t.daemon and t.is_alive()
    assert heap.start_trimming(1) is t
    assert isinstance(heap.trim(), bool)
