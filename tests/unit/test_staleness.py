"""What goes stale and how it shows (issue 19): the calibration drift detector (the median of
measured/predicted cost over a window, a warning once per window outside [1/2, 2], its metrics),
a stale calibration profile, and an agent worker's binding of a corpus unpinned since."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from requester.drift import Drift
from requester.metrics import RequesterMetrics


def test_a_window_outside_the_band_warns_once_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    m = RequesterMetrics()
    d = Drift(
        window=10,
        profile="corpusd calibrate (test)",
        on_window=lambda p, r: m.ratio_median.labels(p).set(r),
        on_drift=lambda p, r: m.drift.labels(p).inc(),
    )
    rng = random.Random(0)

    def feed(prim: str, ratio: float, n: int) -> list[float | None]:
        # noise around ``ratio``: the median, not one sample, decides
        return [d.observe(prim, ratio * rng.uniform(0.8, 1.25) * 1e-3, 1e-3) for _ in range(n)]

    with caplog.at_level(logging.WARNING, "corpusd.requester"):
        assert feed("route", 1.0, 10) == [None] * 10  # in the band: no warning
        assert not caplog.records
        got = feed("route", 9.5, 30)  # three windows 9.5× too slow: three warnings, one each
    closed = [r for r in got if r is not None]
    assert [i for i, r in enumerate(got) if r is not None] == [9, 19, 29]
    assert all(7 < r < 12 for r in closed)
    assert len(caplog.records) == 3
    assert "route: measured/predicted cost median" in caplog.records[0].getMessage()
    assert "corpusd calibrate (test)" in caplog.records[0].getMessage()
    reg = m.registry
    assert (
        reg.get_sample_value(
            "corpusd_requester_calibration_drift_windows_total", {"primitive": "route"}
        )
        == 3
    )
    median = reg.get_sample_value(
        "corpusd_requester_measured_over_predicted_median", {"primitive": "route"}
    )
    assert median == closed[-1]
    # per primitive: a fetch window too fast counts on its own; 2× exactly is still in the band
    caplog.clear()
    with caplog.at_level(logging.WARNING, "corpusd.requester"):
        assert feed("fetch", 0.3, 10)[-1] is not None
        assert [d.observe("local", 2.0, 1.0) for _ in range(10)] == [None] * 10
        assert [d.observe("local", 0.5, 1.0) for _ in range(10)] == [None] * 10
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("fetch:")
    # a decision with no prediction (0 or inf) is no ratio
    assert d.observe("route", 1.0, 0.0) is None and d.observe("route", 1.0, float("inf")) is None
    assert d.ratios["route"] == []


def test_a_profile_is_stale_for_another_model_device_or_age(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from corpusd import env
    from requester.predicate import Profile

    day, now = 86400.0, 1.8e9
    p = Profile(model_fingerprint="sha256:aa", device="cpu X x2", created_at=now - 2 * day)
    assert p.stale("sha256:aa", "cpu X x2", 30 * day, now) == ""
    assert "model sha256:aa" in p.stale("sha256:bb", "cpu X x2", 30 * day, now)
    assert "measured on cpu X x2, this is cuda H100" in p.stale(
        "sha256:aa", "cuda H100", 30 * day, now
    )
    assert "2.0 days old (more than 1)" in p.stale("sha256:aa", "cpu X x2", day, now)
    assert "no calibration" in Profile().stale("sha256:aa", "cpu X x2", 30 * day, now)
    monkeypatch.delenv("CORPUSD_CALIBRATE", raising=False)
    assert env.calibrate_mode() == "auto" and env.calibrate_mode("off") == "off"
    monkeypatch.setenv("CORPUSD_CALIBRATE", "never")
    with pytest.raises(ValueError, match=r"CORPUSD_CALIBRATE='never': one of auto, always, off"):
        env.calibrate_mode()


def test_the_coordinator_voids_bindings_of_unpinned_or_republished_corpora() -> None:
    """What ReportWorker's reply tells a worker to drop (issue 19): a corpus retired or gone, or
    one unpinned and published again between two of its reports (its page table changed)."""
    from types import SimpleNamespace

    from corpusd.coordinator.service import CoordinatorService
    from corpusd.v1 import coordinator_pb2 as pb

    rows: dict[str, SimpleNamespace] = {}

    async def corpus(cid: str) -> SimpleNamespace | None:  # the state stores are async
        return rows.get(cid)

    fake = SimpleNamespace(bound_since={}, state=SimpleNamespace(corpus=corpus))

    def report(now: float, *corpora: str) -> list[str]:
        req = pb.WorkerReport(worker_id="w", corpora=list(corpora))
        return asyncio.run(CoordinatorService._unpinned(fake, req, now))  # type: ignore[arg-type]

    rows["a"] = SimpleNamespace(state="ready", updated_at=10.0)
    rows["b"] = SimpleNamespace(state="ready", updated_at=10.0)
    assert report(11, "a", "b") == [] and report(12, "a", "b") == []
    rows["a"] = SimpleNamespace(state="retired", updated_at=13.0)
    assert report(14, "a", "b") == ["a"]  # unpinned
    assert report(15, "b") == []  # the worker dropped it
    rows["b"] = SimpleNamespace(state="ready", updated_at=16.0)  # unpinned and re-pinned at 16
    assert report(17, "b") == ["b"]  # bound before 16: its page table is stale
    assert report(18) == [] and report(19, "b") == []  # dropped, bound afresh: kept
    assert report(20, "ghost") == ["ghost"]  # deleted (or never pinned here)
    rows["b"] = SimpleNamespace(state="pinning", updated_at=21.0)
    assert report(22, "b") == ["b"]
