"""The per-request kernel choice (``holder.kernels.prefer_triton``), on CPU: against the GPU
timings it was derived from, stated here, and the ``auto`` registry entry that dispatches on it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from holder import kernels
from holder.kernels import REGISTRY, choose, prefer_triton

SLACK = 1.10  # the chosen kernel may be this much slower than the faster one (bench noise)

# (rows, heads, FlashMLA µs, Triton µs): each kernel's best at that shape on one H200, as
# tools/bench_gpu.py and tools/bench_gpu_pair.py measured them (bench/results/gpu-single-h200.json
# and gpu-pair-h200x2.json, not read here). Triton wins below 16 heads at any row count and
# below ~16 rows at any head count; FlashMLA (padded to 64 heads) wins above both.
MEASURED = (
    (1, 16, 68, 18), (1, 64, 65, 28), (1, 128, 66, 28), (4, 64, 67, 29), (8, 128, 67, 34),
    (16, 16, 77, 22), (16, 64, 70, 39), (16, 128, 72, 72), (32, 16, 84, 33), (32, 128, 79, 117),
    (38, 64, 82, 112), (64, 16, 90, 55), (64, 64, 85, 122), (64, 128, 92, 203),
    (109, 16, 105, 94), (109, 64, 101, 209), (548, 16, 430, 456), (548, 128, 704, 1448),
    (952, 16, 690, 643), (952, 64, 708, 1286),
)  # fmt: skip


@pytest.mark.parametrize(("rows", "heads", "fl", "tr"), MEASURED)
def test_choice_is_the_faster_kernel_at_every_measured_point(
    rows: int, heads: int, fl: float, tr: float
) -> None:
    chosen = tr if prefer_triton(rows, heads) else fl
    assert chosen <= SLACK * min(fl, tr), (
        f"{rows=}, {heads=}: chose {'triton' if chosen == tr else 'flashmla'} at {chosen:.0f} "
        f"µs; flashmla {fl:.0f}, triton {tr:.0f}"
    )


def test_choice_edges() -> None:
    assert prefer_triton(952, 16) and prefer_triton(1, 1)  # few heads: always Triton
    assert prefer_triton(16, 64) and not prefer_triton(17, 64)  # h > 16: Triton to 16 rows
    assert prefer_triton(1, 128) and not prefer_triton(17, 128) and not prefer_triton(64, 100)


def _fake(name: str, calls: list[str]) -> kernels.Kernel:
    def fn(
        q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(name)
        return q.new_zeros(q.shape[0], q.shape[1], d_v), torch.zeros(q.shape[:2])

    return replace(REGISTRY[name], fn=fn, available=lambda device: True)


def test_auto_dispatches_per_request_where_both_gpu_kernels_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setitem(REGISTRY, "flashmla", _fake("flashmla", calls))
    monkeypatch.setitem(REGISTRY, "triton", _fake("triton", calls))
    k = choose("auto", "cuda:0", torch.bfloat16, 576, 512)
    assert k.name == "flashmla|triton"
    assert k.resolve(64, 128).name == "flashmla" and k.resolve(64, 16).name == "triton"
    kv, idx = torch.zeros(8, 576), torch.zeros(32, 128, dtype=torch.int32)
    for rows, heads in ((32, 128), (4, 16), (4, 64), (32, 64), (4, 128)):
        k.fn(torch.zeros(rows, heads, 576), kv, idx[:rows], 0.1, 512)
    assert calls == ["flashmla", "triton", "triton", "flashmla", "triton"]
    # a float32 pool: only Triton fits, and it runs every request
    t = choose("auto", "cuda:0", torch.float32, 576, 512)
    assert t.name == "triton" and t.resolve(64, 128) is t
    # a named kernel is never swapped per request
    assert choose("flashmla", "cuda:0", torch.bfloat16, 576, 512).resolve(1, 16).name == "flashmla"
