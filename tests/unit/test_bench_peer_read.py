"""``tools/bench_peer_read.py``'s variants on CPU (the timing stubbed out): every way of reading
the pool, staged or in place, split or not, gives the local pool's output."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from requester.sglang import device
from tools import bench_peer_read


def test_every_variant_attends_the_same_rows_as_the_local_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def untimed(fn: Any, reps: int, n: int) -> dict[str, float]:
        fn()
        return {"median_us": 1.0, "min_us": 1.0, "max_us": 1.0}

    monkeypatch.setattr(bench_peer_read, "trials", untimed)
    a = argparse.Namespace(topk=64, heads=4, pool_tokens=256, chunks=[2, 4, 8], reps=1, trials=1)
    g = torch.Generator().manual_seed(0)
    local = torch.randn(256, bench_peer_read.D_QK, generator=g).bfloat16()

    def partial(qq: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> Any:
        return device.sparse_partial(qq, kv, idx, 0.05, bench_peer_read.D_V, False)

    row = bench_peer_read.measure_rows(a, 5, local.clone(), local, partial, g)
    timed = {k for k, v in row.items() if isinstance(v, dict) and "max_abs_diff_vs_local" in v}
    assert timed == {"local", "in_place", "split_in_place", "staged/2", "staged/4",
                     "split_staged/2", "split_staged/4"}  # fmt: skip
    assert all(row[k]["max_abs_diff_vs_local"] < 1e-5 for k in timed), row
    assert row["copy"]["bytes"] == 5 * 64 * bench_peer_read.D_QK * 2
    assert {"two_call", "one_call"} <= set(row)  # a whole layer both ways, timed
    assert "staged" in bench_peer_read.table({"rows": [row]})
