"""Timing helpers and random inputs shared by the GPU benchmarks (``tools/bench_gpu.py``,
``bench_gpu_pair.py``, ``bench_fp8.py``): CUDA-event device time, host wall time after a
synchronize, CUDA-graph replay time, measured copy and matmul ceilings, the JSON writer."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

D, D_V, K = 576, 512, 2048


def device_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> list[float]:
    """Per-repetition device time (ms) of ``fn`` measured with events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def wall_us(fn: Callable[[], Any], reps: int, warmup: int = 3) -> list[float]:
    """Host wall time (µs) of ``fn`` + synchronize, per repetition."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def graph_us(fn: Callable[[], Any], per_graph: int = 10, reps: int = 10) -> list[float]:
    """Device time (µs) per call of ``fn``, from replays of a CUDA graph of ``per_graph`` calls:
    host launch gaps are out of the number (an event pair around an eager call would measure the
    host's launch overhead whenever the GPU is starved, which small decode calls always are)."""
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = device_ms(graph.replay, reps)
    del graph
    return [1e3 * t / per_graph for t in times]


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def ceilings(dev: torch.device) -> dict[str, float]:
    """Measured copy bandwidth (GB/s, read + write) and dense bf16 matmul rate (TFLOP/s)."""
    a = torch.randn(1 << 28, device=dev, dtype=torch.bfloat16)  # 512 MiB
    b = torch.empty_like(a)
    t = med(device_ms(lambda: b.copy_(a), 10))
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    tm = med(device_ms(lambda: x @ y, 10))
    return {"copy_GBps": 2 * a.numel() * 2 / t / 1e6, "bf16_TFLOPs": 2 * 8192**3 / tm / 1e9}


def kernels_on(dev: torch.device) -> dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    from corpusd.kernels.registry import REGISTRY

    return {
        name: REGISTRY[name].fn
        for name in ("flashmla", "triton", "torch")
        if REGISTRY[name].available(str(dev))
    }


def random_pool(tokens: int, dev: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(tokens, D, generator=g, device=dev, dtype=torch.bfloat16)


def random_request(
    g: torch.Generator, rows: int, h: int, k: int, pool_tokens: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(rows, h, D, generator=g, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, pool_tokens, (rows, k), generator=g, device=dev, dtype=torch.int32)
    return q, idx


def save(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def command() -> str:
    """The command line that ran this benchmark (``python -m tools.<its module> …``)."""
    return f"python -m tools.{Path(sys.argv[0]).stem} " + " ".join(sys.argv[1:])


def env_info(dev: torch.device) -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }
