"""``tools/bench_pin.py --sglang`` without sglang or a GPU: the launch flags, the skips, the
ratios, and the timing and server code run against ``tests/support/fake_sglang.py`` (SGLang's
HTTP surface, limits and cache on loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_sglang import install
from tools.bench_pin import bench_positions
from tools.pin_sglang import (
    CHUNK,
    HEADROOM,
    compare,
    context_for,
    failures,
    positions_skip,
    prefill_flags,
    run_sglang,
    sglang_skip,
    time_prefill,
)
from tools.sglang_server import Server, sglang_flags

ROOT = Path(__file__).resolve().parents[2]


def flag(flags: list[str], name: str) -> str:
    assert flags.count(name) == 1, f"{name} given {flags.count(name)} times in {flags}"
    return flags[flags.index(name) + 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_flags_are_the_shared_ones_with_room_for_the_longest_request() -> None:
    ctx = context_for(131_203, 163_840)
    assert ctx == 132_096 and ctx % 1024 == 0 and ctx >= 131_203 + HEADROOM
    assert context_for(163_830, 163_840) == 163_840, "capped at the model's positions"
    flags = prefill_flags(ctx)
    assert flag(flags, "--context-length") == flag(flags, "--max-total-tokens") == str(ctx)
    assert flag(flags, "--chunked-prefill-size") == str(CHUNK)
    assert flag(flags, "--max-running-requests") == "4"
    shared = sglang_flags()
    for name in ("--attention-backend", "--nsa-prefill-backend", "--kv-cache-dtype"):
        assert flag(flags, name) == flag(shared, name), name
    assert "--skip-tokenizer-init" in flags


def test_skips_say_which_limit_and_why() -> None:
    assert positions_skip(163_840, 163_840) is None
    # the bench raises the checkpoint's positions to its largest size (rounded up to 4,096)
    assert bench_positions("sglang", [16_384, 262_144], -1) == 266_240
    assert bench_positions("sglang", [16_384, 65_536], -1) is None  # the preset's suffice
    assert bench_positions("sglang", [262_144], 0) is None  # kept: 256k is then skipped
    assert bench_positions("cpu", [4_096], 300_000) == 300_000
    skip = positions_skip(262_144, 163_840)
    assert skip is not None and skip["skipped"] == "positions" and "163,840" in skip["reason"]
    ctx = 132_096
    assert sglang_skip(ctx - HEADROOM, ctx) is None
    assert sglang_skip(ctx - HEADROOM + 1, ctx) == {
        "skipped": "context-length",
        "reason": f"{ctx - HEADROOM + 1:,} tokens + {HEADROOM} > --context-length {ctx:,} "
        "(capped at the model's positions)",
    }
    # SGLang's own limit: min(context - 1, pool - 1) - 5. A pool smaller than asked is memory.
    small = {"max_req_input_len": 100_000 - 6, "max_total_num_tokens": 100_000}
    assert sglang_skip(99_993, ctx, small) is None
    assert sglang_skip(99_994, ctx, small)["skipped"] == "memory"  # type: ignore[index]
    full = {"max_req_input_len": ctx - 6, "max_total_num_tokens": ctx}
    assert sglang_skip(ctx - HEADROOM, ctx, full) is None


def test_ratios_are_corpusd_over_sglang_and_the_goal_is_checked_on_measured_sizes() -> None:
    corpusd = {
        16384: {"tokens": 16483, "tok_per_s": 13000.0},
        65536: {"tokens": 65590, "tok_per_s": 6000.0},
        262144: {"size": 262144, "skipped": "positions", "reason": "past the positions"},
    }
    sglang = {"rows": {"16384": {"tok_per_s": 20000.0}, "65536": {"tok_per_s": 15000.0}}}
    out = compare(corpusd, sglang)
    by = {r["size"]: r for r in out["rows"]}
    assert by[16384]["ratio"] == 0.65 and by[65536]["ratio"] == 0.4
    assert by[262144]["ratio"] is None and by[262144]["why"] == "past the positions"
    assert out["min_ratio"] == 0.4 and out["goal_met"] is False
    assert compare({16384: corpusd[16384]}, sglang)["goal_met"] is True
    failed = compare({16384: corpusd[16384]}, {"failed": "RuntimeError: sglang exited (1)"})
    assert failed["goal_met"] is None and "sglang exited" in failed["rows"][0]["why"]


def fake_server(tmp_path: Path) -> Server:
    """A stock :class:`Server` (the real launch code) with a 4,096-token context."""
    return Server(
        "stock", tmp_path, free_port(), None, tmp_path / "s.log", flags=prefill_flags(4096)
    )


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``python -m sglang.launch_server`` is the fake for this test; its trace file."""
    install(tmp_path / "site")
    path = os.pathsep.join([str(tmp_path / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("FAKE_SGLANG_TRACE", str(trace))
    return trace


def test_time_prefill_flushes_before_each_rep_and_takes_the_median(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_SLEEPS", "0.30,0.05,0.10,0.15,0.15,0.15")
    server = fake_server(tmp_path)
    try:
        server.wait(60)
        row = time_prefill(server.url, list(range(3000)), reps=3)
        short = time_prefill(server.url, list(range(10)), reps=5, budget_s=0.2)
    finally:
        server.stop()
    assert row["tokens"] == 3000 and row["reps"] == 3 and len(row["ttft_s"]) == 3
    assert 0.10 <= row["ttft_median_s"] < 0.15, f"{row=}: the median of 0.30, 0.05, 0.10 s"
    assert row["tok_per_s"] == pytest.approx(3000 / row["ttft_median_s"], rel=1e-3)
    assert row["server_e2e_latency_median_s"] == 0.001
    assert short["reps"] == 2, f"{short=}: no third rep once 0.2 s of timed prefill is spent"
    paths = [json.loads(ln)["path"] for ln in fake.read_text().splitlines()]
    assert paths == ["/flush_cache", "/generate"] * 5
    sampling = json.loads(fake.read_text().splitlines()[1])["sampling"]
    assert sampling["max_new_tokens"] == 1


def test_a_cached_prefill_is_refused(fake: Path, tmp_path: Path) -> None:
    server = fake_server(tmp_path)
    try:
        server.wait(60)
        time_prefill(server.url, [5] * 100, reps=1)
        import tools.pin_sglang as ps

        real = ps.flush
        ps.flush = lambda url: None  # as if /flush_cache were skipped
        try:
            with pytest.raises(RuntimeError, match="100 of 100 tokens came from SGLang's cache"):
                time_prefill(server.url, [5] * 100, reps=1)
        finally:
            ps.flush = real
    finally:
        server.stop()


def test_run_sglang_warms_up_times_and_skips_what_the_pool_cannot_hold(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_SGLANG_POOL", "9000")  # less than the context asked for: memory
    monkeypatch.setenv("FAKE_SGLANG_S_PER_TOKEN", "1e-5")
    ids = {2048: [1] * 2100, 8192: [2] * 8300, 200_000: [3] * 12_000}
    out = run_sglang(tmp_path, ids, positions=163_840, port=free_port(), log=tmp_path / "s.log")
    assert "failed" not in out, out
    assert flag(out["argv"], "--context-length") == str(context_for(12_000, 163_840))
    assert out["server"]["max_total_num_tokens"] == 9000 and out["warmup"]["tokens"] == 2100
    rows = out["rows"]
    assert rows["2048"]["tokens"] == 2100 and rows["2048"]["reps"] == 5
    assert rows["8192"]["tokens"] == 8300 and rows["8192"]["tok_per_s"] > 0
    assert rows["200000"]["skipped"] == "memory", rows["200000"]
    sizes = [json.loads(ln).get("tokens") for ln in fake.read_text().splitlines()]
    timed = [s for s in sizes if s is not None]
    assert timed == [2100] + [2100] * 5 + [8300] * 5, "warm-up first, then 5 reps per size"


def test_bench_pin_sglang_end_to_end_on_the_cpu(fake: Path, tmp_path: Path) -> None:
    """The lead's GPU command with ``--device cpu`` and the fake server: the pinned ids reach
    SGLang, a size past the positions is skipped on both sides (``--positions 0`` keeps the
    preset's; by default the bench raises them), the ratio is in the JSON."""
    out = tmp_path / "pin.json"
    cmd = [
        sys.executable, "-m", "tools.bench_pin", "--device", "cpu", "--preset", "sglang",
        "--sizes", "600", "200000", "--chunk", "1024", "--dtype", "bfloat16", "--no-tar",
        "--sglang", "--sglang-port", str(free_port()), "--sglang-reps", "2", "--out", str(out),
        "--positions", "0",  # the preset's: 200k is then skipped on both sides
    ]  # fmt: skip
    env = {**os.environ, "FAKE_SGLANG_S_PER_TOKEN": "2e-4"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["command"].endswith(" ".join(cmd[3:])) and res["index_topk"] == 2048
    (row,) = res["rows"]
    sg = res["sglang"]["rows"]["600"]
    assert sg["tokens"] == row["tokens"] and sg["reps"] == 2
    first = [json.loads(ln) for ln in fake.read_text().splitlines() if "head" in json.loads(ln)]
    assert first[0]["head"][0] == 256, "the pinned ids start with the byte preset's BOS"
    (cmp600, cmp200k) = res["comparison"]["rows"]
    assert cmp600["ratio"] == round(row["tok_per_s"] / sg["tok_per_s"], 3)
    assert cmp200k["ratio"] is None and "163,840 positions" in cmp200k["why"]
    assert res["skipped"][0]["size"] == 200000 and out.with_suffix(".sglang.log").exists()


def test_a_server_that_does_not_start_is_recorded_and_fails_the_run(tmp_path: Path) -> None:
    """No fake on the path and no checkpoint: whether sglang is installed or not, the server
    exits; the result says so with its log, and the comparison says why there is no ratio."""
    out = run_sglang(tmp_path, {600: [1] * 600}, 163_840, free_port(), tmp_path / "s.log")
    assert "sglang exited" in out["failed"] and out["rows"] == {}
    assert failures(out) == [f"server: {out['failed']}"]
    row = compare({600: {"tokens": 600, "tok_per_s": 100.0}}, out)["rows"][0]
    assert row["ratio"] is None and "sglang exited" in row["why"]
