"""tools/bench_share.py's arithmetic: the equal-HBM budget, SGLang's pool bytes, and quantiles
and counters read from Prometheus text (the GPU run itself is a script, not a test)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tools.bench_share import (
    counter,
    exactness,
    exactness_lines,
    headline,
    histogram,
    pool_bytes,
    quantile,
    route_budget,
    staging,
)

CFG = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128, "num_hidden_layers": 4}


def test_pool_bytes_counts_the_latent_row_and_the_fp8_index_key_per_layer() -> None:
    assert pool_bytes(CFG) == 4 * (2 * 576 + 128 + 4)
    # FlashMLA's fp8 row: 512 fp8 + 4 float32 scales + 64 bf16 rope = 656 bytes
    assert pool_bytes(CFG, "fp8_e4m3") == 4 * (656 + 132)


def test_route_budget_charges_the_pinned_copy_to_every_worker_equally() -> None:
    b = pool_bytes(CFG)
    # a copy as large as one worker's whole budget, shared by 2 workers: each gives up half
    assert route_budget(1000, 2, 1000 * b, b) == 500
    assert route_budget(1000, 4, 1000 * b, b) == 750
    assert route_budget(1000, 1, 2000 * b, b) < 0  # the copy alone is over budget


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile() -> None:
    buckets = {0.001: 0.0, 0.002: 5.0, 0.004: 10.0, math.inf: 10.0}
    assert quantile(buckets, 0.5) == pytest.approx(0.002)
    assert quantile(buckets, 0.75) == pytest.approx(0.003)
    assert math.isnan(quantile({0.1: 0.0, math.inf: 0.0}, 0.5))
    assert quantile({0.1: 0.0, math.inf: 4.0}, 0.5) == 0.1  # past the last finite edge


def test_counters_and_histograms_sum_every_label_set() -> None:
    text = "\n".join(
        [
            'sglang:generation_tokens_total{model_name="a"} 12.0',
            'sglang:generation_tokens_total{model_name="b"} 3.0',
            'sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="a"} 3.0',
            'sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="b"} 1.0',
            'sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="a"} 4.0',
        ]
    )
    assert counter(text, "sglang:generation_tokens_total") == 15.0
    assert histogram(text, "sglang:inter_token_latency_seconds") == {0.01: 4.0, math.inf: 4.0}


def test_headline_takes_the_best_point_and_the_best_within_the_latency_bound() -> None:
    def point(tps: float, p99: float, errors: int = 0) -> dict:
        m = lambda v: {"median": v, "min": v, "max": v}  # noqa: E731
        return {
            "tokens_per_s": m(tps),
            "itl_server_p99_ms": m(p99),
            "sessions_held_max": m(tps / 100),
            "errors_total": errors,
        }

    h = headline([point(100, 5), point(300, 9), point(500, 30), point(900, 1, errors=1)])
    assert h["tokens_per_s_saturation"] == 500  # the erroring point does not count
    assert h["tokens_per_s_at_2x_itl"] == 300  # p99 9 ms ≤ 2 × 5 ms; 30 ms is not
    assert headline([point(1, 1, errors=2)]) == {"served": False}


def test_exactness_reads_route_against_two_stock_servers() -> None:
    def runs(shift: float) -> list[list[list[float]]]:  # [session][step][vocab]
        return [[[-0.1 - shift, -2.5, -9.0], [-3.0, -0.06, -4.0]]]

    stock = [runs(0.0), runs(0.02)]  # two stock servers: 0.02 apart
    close = exactness(stock, [runs(0.01), runs(0.01)])
    assert close["stock_vs_stock"]["logprob_max_abs_diff"] == pytest.approx(0.02)
    assert close["route_vs_stock"]["logprob_max_abs_diff"] == pytest.approx(0.01)
    assert close["route_vs_route"]["logprob_max_abs_diff"] == 0.0
    assert close["vs_floor"]["noisiest_floor"]["max_over_floor"] == pytest.approx(0.5)
    assert close["vs_floor"]["within_floor"] == {"logprob": True, "forced_agree": True}
    far = exactness(stock, [[[[-3.0, -0.06, -9.0], [-3.0, -0.06, -4.0]]]])
    assert far["route_vs_stock"]["forced_agree_steps"] == 1
    assert far["vs_floor"]["within_floor"]["logprob"] is False
    assert "route_vs_route" not in far  # one route worker: nothing to compare it with
    assert set(exactness(None, [runs(0.0), runs(0.0)])) == {"sessions", "steps", "route_vs_route"}
    lines = exactness_lines(close)
    assert lines[0].startswith("stock_vs_stock  forced 2/2, |Δ log-prob| max 0.020")
    assert lines[-1] == "route over the floor: max ×0.50, mean ×0.50"


def test_gpus_deal_the_workers_over_gpus_on_both_sides(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--gpus 2``: worker i starts with ``--base-gpu-id i mod 2``, stock and corpusd alike, the
    budget flags unchanged; ``--gpus 1`` adds no GPU flag (every worker on the holder's GPU)."""
    import tools.bench_share as bs

    started: list[tuple[str, list[str]]] = []

    class FakeServer:
        def __init__(self, mode: str, *args: Any, flags: list[str], **kw: Any) -> None:
            started.append((mode, flags))

        def wait(self, timeout: float) -> float:
            return 0.0

    monkeypatch.setattr(bs, "Server", FakeServer)
    cd: Any = None
    for mode in ("stock", "route"):
        bs.start_side(mode, 3, tmp_path, cd, 1, 4096, 8192, 0.2, (8,), tmp_path, gpus=2)
    gpu = [f[f.index("--base-gpu-id") + 1] for _, f in started]
    assert gpu == ["0", "1", "0"] * 2
    assert all(f[f.index("--max-total-tokens") + 1] == "4096" for _, f in started)
    started.clear()
    bs.start_side("route", 2, tmp_path, cd, 1, 4096, 8192, 0.2, (8,), tmp_path)
    assert all("--base-gpu-id" not in f for _, f in started)
    with pytest.raises(SystemExit):
        bs.main(["--gpus", "0"])


def test_spread_puts_a_holder_on_each_gpu_with_room_for_an_even_share() -> None:
    """``--spread``: G holders, one per GPU, whose capacities (whole pages) hold the corpus
    together, a few percent over the size asked included, while no G − 1 of them can, so the
    placement spreads it over all G; without it one holder on the given device holds all."""
    from tools.bench_share import PAGE, holder_layout

    assert holder_layout(32872, "cuda:0", 4, False) == (1, "cuda:0", 40960)
    n, devices, _ = holder_layout(32768, "cuda:0", 4, True)
    assert (n, devices) == (4, "cuda:0,cuda:1,cuda:2,cuda:3")
    for asked, gpus in [(32768, 4), (32768, 2), (8000, 4), (131072, 8)]:
        _, _, cap = holder_layout(asked, "cuda:0", gpus, True)
        pinned = asked * 101 // 100  # the pin ran 0.3 % over in the N = 4 run
        assert cap % PAGE == 0 and gpus * cap >= pinned > (gpus - 1) * cap, (asked, gpus, cap)
    with pytest.raises(SystemExit):
        __import__("tools.bench_share", fromlist=["main"]).main(["--spread"])


def test_pin_engine_pins_through_a_capture_server_else_corpusd_prefills(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--pin-engine``: the corpus goes through ``start_pinned`` with an engine port (stock's
    own pages), to the same holders and capacity; without it corpusd prefills on ``--device``."""
    import argparse

    import tools.bench_share as bs

    calls: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(bs, "start_pinned", lambda *a, **k: calls.append(("engine", a, k)))
    monkeypatch.setattr(bs, "start_corpusd", lambda *a, **k: calls.append(("corpusd", a, k)))
    a = argparse.Namespace(pin_engine=True, port=30200, device="cuda:0")
    src = tmp_path / "src"
    bs.pin_shared(a, tmp_path, tmp_path / "m", "shared", src, 4, "cuda:0,cuda:1", 9216)
    a.pin_engine = False
    bs.pin_shared(a, tmp_path, tmp_path / "m", "shared", src, 4, "cuda:0,cuda:1", 9216)
    (k1, a1, _), (k2, a2, kw2) = calls
    assert k1 == "engine" and a1[3:] == (4, "cuda:0,cuda:1", "auto", 30290, {"shared": src}, 9216)
    assert k2 == "corpusd" and a2[3:] == (4, "cuda:0,cuda:1", "plain")
    assert kw2 == {"capacity_tokens": 9216, "pin_device": "cuda:0", "sources": {"shared": src}}


def test_staging_reports_the_route_workers_buffer_outside_k(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048}
    monkeypatch.setenv("CORPUSD_SGLANG_STAGE_ROWS", "64")
    got = staging(cfg, peers=True)
    assert got["staged"] and got["buffer_bytes_per_worker"] == 64 * 2048 * 1152
    assert not got["counted_in_k"]
    assert staging(cfg, peers=False)["buffer_bytes_per_worker"] == 0
    monkeypatch.setenv("CORPUSD_SGLANG_STAGE_ROWS", "0")
    assert not staging(cfg, peers=True)["staged"]


def test_route_alt_env_takes_corpusd_variables_checked_as_the_plugin_reads_them() -> None:
    from tools.bench_share import parse_env

    assert parse_env("CORPUSD_SGLANG_STAGE_ROWS=0, CORPUSD_SGLANG_ONE_CALL=1") == {
        "CORPUSD_SGLANG_STAGE_ROWS": "0",
        "CORPUSD_SGLANG_ONE_CALL": "1",
    }
    assert parse_env("") == {}
    for bad, why in (
        ("CORPUSD_SGLANG_STAGE_ROWS", "KEY=VALUE"),
        ("NOT_CORPUSD=1", "not a corpusd variable"),
        ("CORPUSD_SGLANG_STAGE_ROWS=-3", "CORPUSD_SGLANG_STAGE_ROWS"),
        ("CORPUSD_SGLANG_STAGE_ROWS=many", "CORPUSD_SGLANG_STAGE_ROWS"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_env(bad)


def test_the_table_prints_the_alternative_corpusd_run_beside_stock(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tools.bench_share import print_table

    point = {
        "fraction": 0.5, "k_tokens": 100, "k_route_tokens": 80,
        "stock": {"headline": {"tokens_per_s_saturation": 1000.0, "sessions_held_max": 10}},
        "corpusd": {"headline": {"tokens_per_s_saturation": 1200.0, "sessions_held_max": 40}},
        "corpusd_over_stock_saturation": 1.2,
        "corpusd_alt": {"env": {"CORPUSD_SGLANG_STAGE_ROWS": "0"},
                        "headline": {"tokens_per_s_saturation": 900.0}},
        "corpusd_alt_over_stock_saturation": 0.9,
    }  # fmt: skip
    print_table({"points": [point]})
    out = capsys.readouterr().out
    assert "1200" in out and "{'CORPUSD_SGLANG_STAGE_ROWS': '0'}: 900 tok/s, 0.90x stock" in out
