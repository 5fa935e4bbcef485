"""The one kernel choice (``corpusd.kernels.registry``), on CPU: the per-request rule
(``prefer_triton``) against the GPU bench numbers it was derived from, the ``auto`` registry entry
that dispatches on it, and the start-up report in logs and ``/metrics``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from corpusd.kernels import registry as kernels
from corpusd.kernels.registry import REGISTRY, choose, prefer_triton

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


def test_report_logs_the_choice_once_and_sets_kernel_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every attending process reports its choice: one log line per (role, kernel, device),
    and ``kernel_info{kernel, device}`` = 1 in its ``/metrics``."""
    from corpusd.metrics import Metrics

    m = Metrics("corpusd_test_")
    gauge = m.kernel_info()
    k = choose("auto", "cpu", torch.float32, 576, 512)
    why = kernels.passed_over(k, "cpu", torch.float32, 576, 512)
    assert k.name == "torch" and len(why) == 2, why  # flashmla and triton, each with a reason
    with caplog.at_level("INFO", logger="corpusd.kernels"):
        for _ in range(2):
            kernels.report(k, "cpu", "test role", gauge, why)
    lines = [r.getMessage() for r in caplog.records if "test role" in r.getMessage()]
    assert len(lines) == 1 and "torch attention partials" in lines[0], lines
    assert "flashmla needs a bfloat16 model" in lines[0] and "triton needs a CUDA GPU" in lines[0]
    got = m.registry.get_sample_value(
        "corpusd_test_kernel_info", {"kernel": "torch", "device": "cpu"}
    )
    assert got == 1.0


def test_per_request_choice_is_described_in_the_log() -> None:
    fl, tr = (replace(REGISTRY[n], available=lambda device: True) for n in ("flashmla", "triton"))
    k = kernels.per_request(fl, tr)
    assert kernels.describe(k, noun="attention partials") == (
        f"flashmla|triton attention partials ({kernels.PER_REQUEST_RULE})"
    )
    assert k.misfit("cuda:0", torch.bfloat16, 576, 512, "fp8_e4m3") == (
        "flashmla|triton does not read fp8_e4m3 rows"
    )


def test_compacted_streams_take_the_kernels_that_walk_only_the_valid_indices() -> None:
    """A holder told its requests' indices come valid first runs Triton skipping blocks of -1
    where it would run Triton (the pair's Triton half too), and keeps FlashMLA over the whole
    width (told each row's count it measured slower); the others are kept. Neither variant is
    one ``auto`` picks."""
    flash, triton = REGISTRY["flashmla"], REGISTRY["triton"]
    assert kernels.for_compacted(flash) is flash
    assert kernels.for_compacted(triton) is kernels.TRITON_SKIP
    pair = kernels.for_compacted(kernels.per_request(flash, triton))
    assert pair.name == "flashmla|triton+skip"
    assert kernels.for_compacted(REGISTRY["torch"]) is REGISTRY["torch"]
    assert {kernels.TRITON_SKIP.name, kernels.FLASHMLA_LENGTHS.name}.isdisjoint(REGISTRY)
