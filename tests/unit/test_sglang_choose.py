"""The SGLang plugin's predicate (requester/sglang/choose.py), its variables and its metrics
server (CPU; no sglang)."""

from __future__ import annotations

import json
import logging
import math
import socket
import urllib.request
from pathlib import Path

import pytest
import torch

from requester.fanout import Fanout
from requester.plan import GroupWork
from requester.predicate import Predicate, Profile
from requester.sglang import choose
from requester.sglang.host_path import pad_cols
from requester.sglang.metrics import ENV_PORT, PluginMetrics, metrics_port, serve


def _group(n: int = 4, k: int = 256) -> GroupWork:
    canon = torch.arange(n * k).reshape(n, k)
    canon[0, -10:] = -1
    return GroupWork(0, "h0:1", torch.arange(n), canon.to(torch.int32), canon)


def test_primitive_and_profile_variables_are_checked(tmp_path: Path) -> None:
    assert choose.primitive({}) == "auto"
    assert choose.primitive({choose.ENV_PRIMITIVE: " Fetch "}) == "fetch"
    with pytest.raises(ValueError, match="stock SGLang's own prefill"):
        choose.primitive({choose.ENV_PRIMITIVE: "local"})
    with pytest.raises(ValueError, match=r"=.?rout.?: one of auto, route, fetch"):
        choose.primitive({choose.ENV_PRIMITIVE: "rout"})
    with pytest.raises(ValueError, match="no such file"):
        choose.profile({choose.ENV_PROFILE: str(tmp_path / "nope.json")})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a corpusd calibration profile"):
        choose.profile({choose.ENV_PROFILE: str(tmp_path / "bad.json")})
    Profile(alpha_us=7.0, source="test").save(tmp_path / "p.json")
    assert choose.profile({choose.ENV_PROFILE: str(tmp_path / "p.json")}).alpha_us == 7.0


def test_decide_takes_the_cheaper_by_the_cost_model_and_obeys_force() -> None:
    """Auto picks route or fetch by the predicate's arithmetic (never local: the plugin cannot
    re-prefill); cached pages make fetch cheap; a fetch that cannot fit the cache is out."""
    slow_wire = Profile(alpha_us=10.0, beta_bytes_per_us=1.0)  # pulling pages is expensive
    c = choose.Chooser(Predicate(slow_wire, "auto"), PluginMetrics())
    g = _group()
    first = c.decide(g, 64, 576, 512, missing_pages=64, page_bytes=64 * 576 * 2, fits=True)
    assert first.pick == "route" and math.isinf(first.predicted_us["local"])
    cached = c.decide(g, 64, 576, 512, missing_pages=0, page_bytes=64 * 576 * 2, fits=True)
    assert cached.pick == "fetch"
    assert cached.predicted_us["fetch"] < cached.predicted_us["route"]
    assert c.decide(g, 64, 576, 512, 0, 1, fits=False).pick == "route"
    forced = choose.Chooser(Predicate(slow_wire, "fetch"), PluginMetrics())
    assert forced.decide(g, 64, 576, 512, 16, 64 * 576 * 2, fits=True).pick == "fetch"
    assert forced.decide(g, 64, 576, 512, 16, 1, fits=False).pick == "route"
    assert forced.metrics.fallbacks.labels("fetch", "route")._value.get() == 1
    r = choose.Chooser(Predicate(slow_wire, "route"), PluginMetrics())
    assert r.decide(g, 64, 576, 512, 0, 1, fits=True).pick == "route"


def test_record_exports_the_decision_and_feeds_drift(tmp_path: Path) -> None:
    """The plugin's decisions are recorded by the engine's one recorder (Fanout.record): the
    plugin's metrics (per layer and holder too) and its trace, with the step they were made in."""
    m = PluginMetrics()
    trace = tmp_path / "t.jsonl"
    c = choose.Chooser(Predicate(Profile(), "auto"), m, str(trace))
    engine = Fanout(Predicate(Profile(), "route"), m, transport="grpc", trace=c.trace)
    engine.drift.window = 2
    g = _group()
    c.new_step(("corpusd:a:1",), "decode")
    d = c.decide(g, 64, 576, 512, 0, 1, fits=True)
    predicted = d.predicted_us[d.pick] / 1e6
    for _ in range(2):
        engine.record(3, g, d, 4 * predicted, c.forced, fetched_pages=0)
    c.close()
    assert m.decisions.labels(d.pick, "no")._value.get() == 2
    assert m.group_decisions.labels(d.pick, "3", "h0:1")._value.get() == 2
    assert m.misprediction.labels(d.pick)._value.get() == pytest.approx(4.0)
    assert m.ratio_median.labels(d.pick)._value.get() == pytest.approx(4.0)  # a closed window
    assert m.drift.labels(d.pick)._value.get() == 1  # 4 is outside [1/2, 2]
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["rids"] == ["corpusd:a:1"] and lines[0]["layer"] == 3
    assert lines[0]["rows"] == 4 and lines[0]["k"] == 256
    assert "local" not in lines[0]["predicted_us"]  # inf: never a choice, not in the JSON
    assert lines[0]["step"] == 1 and lines[0]["mode"] == "decode" and lines[0]["force"] == "auto"
    assert lines[0]["holder"] == "h0:1" and lines[0]["fetched_pages"] == 0


def test_local_terms_fit_the_sparse_partial_on_this_device() -> None:
    base, slope = choose.local_terms(torch.device("cpu"), 16, 576, 512, False, repeats=1)
    assert base >= 0 and slope > 0


def test_pad_cols_pads_to_whole_blocks_of_unused() -> None:
    rows = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    out = pad_cols(rows, 4)
    assert out.shape == (2, 4) and out.dtype == torch.int32 and bool((out[:, 3] == -1).all())
    assert pad_cols(rows[:, :0], 128).shape == (2, 128)  # never an empty top-k
    assert pad_cols(torch.zeros(1, 256, dtype=torch.int32), 128).shape == (1, 256)


def test_metrics_port_and_server(caplog: pytest.LogCaptureFixture) -> None:
    assert metrics_port({}) is None and metrics_port({ENV_PORT: "9100"}) == 9100
    for bad in ("0", "70000", "x"):
        with pytest.raises(ValueError, match=f"{ENV_PORT}={bad!r}"):
            metrics_port({ENV_PORT: bad})
    m = PluginMetrics()
    m.group_decisions.labels("fetch", "2", "h:1").inc()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve(m, port) and serve(m, port)  # once per process and port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'corpusd_requester_sglang_group_decisions_total{holder="h:1",layer="2",' in body
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with caplog.at_level(logging.WARNING, "corpusd.sglang"):
            assert serve(PluginMetrics(), busy.getsockname()[1]) is False
    assert "cannot serve metrics" in caplog.text


def test_timings_resolve_gpu_events_at_flush(caplog: pytest.LogCaptureFixture) -> None:
    """GPU stages are read from their events only when the log line is written and only once
    done (a flush never waits for the GPU), each pair's elapsed time counted once, host stages
    beside them."""
    from requester.sglang.metrics import Timings

    class Event:
        def __init__(self, ms: float, done: bool = True) -> None:
            self.ms, self.done = ms, done

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("a flush waited for the GPU")

        def elapsed_time(self, end: Event) -> float:
            assert end.done, "elapsed_time before the end event is done"
            return end.ms - self.ms

    t = Timings(every_s=3600)
    running = Event(30.0, done=False)
    t.add_gpu("forward (extend) gpu", Event(0.0), Event(4.0))
    t.add_gpu("forward (extend) gpu", Event(10.0), Event(12.0))
    t.add_gpu("forward (extend) gpu", Event(20.0), running)
    t.add("bind (extend)", 0.001)
    with caplog.at_level(logging.INFO, logger="corpusd.sglang"):
        t.flush()
    line = caplog.records[-1].getMessage()
    assert "forward (extend) gpu 3.00 ms × 2" in line and "bind (extend) 1.00 ms × 1" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="corpusd.sglang"):
        t.flush()  # only the running pair is left, still running: no line
    assert not caplog.records
    running.done = True
    with caplog.at_level(logging.INFO, logger="corpusd.sglang"):
        t.flush()  # now it is read, once
    assert "forward (extend) gpu 10.00 ms × 1" in caplog.records[-1].getMessage()


def test_slow_prefill_threshold_reads_seconds_or_falls_back_to_one() -> None:
    """``CORPUSD_SGLANG_PROFILE_SLOW``: unset or empty profiles nothing; a positive number is
    the threshold in seconds; a flag-like value (or a non-positive number) means 1 s."""
    from requester.sglang.metrics import slow_prefill_s

    assert slow_prefill_s(None) is None and slow_prefill_s("") is None
    assert slow_prefill_s("0.05") == 0.05 and slow_prefill_s("2") == 2.0
    assert slow_prefill_s("1") == 1.0 and slow_prefill_s("yes") == 1.0
    assert slow_prefill_s("0") == 1.0 and slow_prefill_s("-3") == 1.0


def test_triton_compile_log_names_the_kernel_and_chains_the_hook_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The diagnosis hook logs the compiled kernel's module, name and specialisation, and calls
    a hook that was there before it with the same arguments (what it returns counts)."""
    knobs = pytest.importorskip("triton").knobs
    from requester.sglang.metrics import log_triton_compiles

    seen: list[dict[str, object]] = []
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw) or True
    try:
        assert log_triton_compiles()
        fn = type("Info", (), {"module": "requester.sglang.device_triton", "name": "_topk"})()
        with caplog.at_level(logging.WARNING, logger="corpusd.sglang"):
            got = knobs.runtime.jit_cache_hook(fn=fn, repr="_topk(n: i32 (D))", key=1)
    finally:
        knobs.runtime.jit_cache_hook = saved
    assert got is True and seen and seen[0]["key"] == 1
    assert "requester.sglang.device_triton._topk: _topk(n: i32 (D))" in caplog.text
