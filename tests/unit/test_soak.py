"""The soak's attribution and summary logic (tools/soak.py) on synthetic data."""

from __future__ import annotations

from typing import Any

from tools.soak import checks, cut_of, explain, near, rss_growth, stray, table


def fault(kind: str, t0: float, t1: float | None, *holders: str) -> dict[str, Any]:
    return {"kind": kind, "t0": t0, "t1": t1} | ({"holders": list(holders)} if holders else {})


def test_a_failure_is_explained_only_by_a_fault_that_removed_every_copy_while_it_ran() -> None:
    faults = [
        fault("kill:holder-0", 10, 12),  # one replica: the other serves
        fault("replicas_down", 30, 35, "holder-0", "holder-1"),
        fault("kill:agent", 50, None),  # still open at the end
    ]
    assert explain({"started": 9, "t": 13}, faults) == ""
    assert explain({"started": 31, "t": 33}, faults) == "replicas_down@30"
    assert explain({"started": 20, "t": 31}, faults) == "replicas_down@30"  # began before it
    assert explain({"started": 38, "t": 45}, faults) == "replicas_down@30"  # within the grace
    assert explain({"started": 41, "t": 45}, faults) == ""  # after the grace
    assert explain({"started": 25, "t": 29}, faults) == ""  # before it
    assert explain({"started": 25, "t": 29.8}, faults) == "replicas_down@30"  # clock skew
    assert explain({"started": 500, "t": 501}, faults) == "kill:agent@50"
    # several: the latest to begin of those still open is named; near() lists every one
    assert explain({"started": 11, "t": 60}, faults) == "kill:agent@50"
    down = ("holder-1", "holder-2")
    reset_then_down = [fault("net_reset:agent", 10, 12), fault("replicas_down", 11, 30, *down)]
    assert explain({"started": 9, "t": 11.5}, reset_then_down) == "replicas_down@11"
    assert explain({"started": 9, "t": 20}, reset_then_down) == "replicas_down@11"
    down_then_reset = [fault("replicas_down", 5, 30, *down), fault("net_reset:agent", 10, 12)]
    assert explain({"started": 9, "t": 11}, down_then_reset) == "net_reset:agent@10"
    assert explain({"started": 9, "t": 20}, down_then_reset) == "replicas_down@5"
    assert [f["kind"] for f in near({"started": 11, "t": 31}, faults)] == [
        "kill:holder-0", "replicas_down"
    ]  # fmt: skip


def test_rss_growth_is_measured_per_incarnation_after_the_warmup() -> None:
    mb = 2**20
    # pid 1 grows 100 → 105 MB after the warmup (its first 100 s: 10 → 100 MB, not counted)
    one = [(0.0, 1, 10 * mb), (100.0, 1, 100 * mb), (200.0, 1, 102 * mb), (300.0, 1, 105 * mb)]
    # pid 2 (a restart) lived too briefly to be measured
    two = [(310.0, 2, 50 * mb), (320.0, 2, 90 * mb)]
    r = rss_growth(one + two, warmup_s=100, min_span_s=60)
    assert r["incarnations"] == 2 and r["measured"] == 1
    assert abs(r["growth"] - 0.05) < 1e-9
    assert r["rss_mb_first"] == 10 and r["rss_mb_last"] == 90 and r["rss_mb_max"] == 105
    assert rss_growth(two, warmup_s=100)["growth"] is None


def summary(**over: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "minutes": 1,
        "faults": {"kill:agent": 1},
        "sessions_ok": 5,
        "sessions_wrong": 0,
        "sessions_failed": 1,
        "sessions_explained": 1,
        "sessions_abandoned": 0,
        "open_sessions_end": 0,
        "rss": {"agent": {"growth": 0.02, "rss_mb_first": 1, "rss_mb_last": 1}},
        "fds": {"agent": {"start": 40, "end": 44}},
        "left_running": [],
        "stray_files": [],
    }
    s.update(over)
    return s


def test_checks_fail_on_each_finding_and_pass_without() -> None:
    assert all(checks(summary()).values())
    bad = {
        "no wrong tokens": summary(sessions_wrong=1),
        "every failure explained": summary(sessions_explained=0),
        "rss growth < 10 %": summary(rss={"agent": {"growth": 0.2}}),
        "open sessions back to 0": summary(open_sessions_end=3),
        "no leaked fds": summary(fds={"agent": {"start": 40, "end": 400}}),
        "no daemon left after down": summary(left_running=["holder-1"]),
        "no stray files": summary(stray_files=["holder-0/x.tmp"]),
    }
    for name, s in bad.items():
        c = checks(s)
        assert not c[name], name
        assert sum(not ok for ok in c.values()) == 1, (name, c)
    assert "FAIL  open sessions back to 0" in table(summary(open_sessions_end=3))


def test_stray_files_are_new_files_other_than_logs_and_state() -> None:
    start = {"holder-0/endpoint.json"}
    end = start | {"holder-0/holder.log", "holder-0/holder.log.1", "agent/x.tmp", "restart"}
    assert stray(start, end) == ["agent/x.tmp", "restart"]


def test_holders_taken_together_explain_a_failure_only_when_they_held_every_replica() -> None:
    # pages 0 and 1 on holders 0+1, page 2 on 1+2: holders 0 and 2 share no page
    pages = [["holder-0", "holder-1"], ["holder-0", "holder-1"], ["holder-1", "holder-2"]]
    assert cut_of(fault("net_drop:holder-0", 0, 1)) == {"holder-0"}
    assert cut_of(fault("net_reset:holder-2", 0, 1)) == {"holder-2"}
    assert cut_of(fault("stop:holder-1", 0, 1, "holder-1")) == {"holder-1"}
    assert cut_of(fault("coordinator_holder", 0, 1, "coordinator", "holder-1")) == {"holder-1"}
    for kind in ("net_delay:holder-0", "net_drop:coordinator", "net_reset:coordinator",
                 "kill:coordinator", "stop:agent"):  # fmt: skip
        assert cut_of(fault(kind, 0, 1)) == set(), kind

    def why(faults: list[dict[str, Any]], started: float = 9, t: float = 12) -> str:
        return explain({"started": started, "t": t}, faults, pages=pages)

    # a partition of one replica's link and the other replica killed: every copy of pages 0, 1
    assert why([fault("kill:holder-1", 8, 14), fault("net_drop:holder-0", 10, 12)]) == (
        "kill:holder-1@8+net_drop:holder-0@10"
    )
    assert why([fault("net_reset:holder-1", 10, 13), fault("stop:holder-2", 11, 12)]) == (
        "net_reset:holder-1@10+stop:holder-2@11"
    )
    # holders 0 and 2 share no page: the replica on holder 1 served
    assert why([fault("kill:holder-0", 8, 14), fault("net_drop:holder-2", 10, 12)]) == ""
    # one at a time (windows apart by more than a rejoin), or one replica alone: not every copy
    assert why([fault("kill:holder-1", 5, 8), fault("net_drop:holder-0", 10, 12)]) == ""
    assert why([fault("net_reset:holder-1", 10, 12)]) == ""
    # a delay removes no copy, on any link, whatever else is down
    assert why([fault("kill:holder-1", 8, 14), fault("net_delay:holder-0", 10, 12)]) == ""
    assert why([fault("net_delay:agent", 10, 12)]) == ""
    # the coordinator's link holds no data: sessions fail over without it
    assert why([fault("net_drop:coordinator", 10, 12), fault("kill:holder-1", 8, 14)]) == ""
    # the clients' own link cut: the session's cache (on the agent alone) is out of reach
    assert why([fault("net_drop:agent", 10, 12)]) == "net_drop:agent@10"
    assert why([fault("net_reset:agent", 10, 12)]) == "net_reset:agent@10"
    # both replicas taken before the session began, still within the grace: its fault
    assert why([fault("kill:holder-1", 1, 6), fault("net_drop:holder-0", 2, 5)], 9, 10) == (
        "kill:holder-1@1+net_drop:holder-0@2"
    )
    # without a placement, any two holders share a page (3 holders, 2 replicas)
    two = [fault("kill:holder-0", 8, 14), fault("net_drop:holder-2", 10, 12)]
    assert explain({"started": 9, "t": 12}, two) == "kill:holder-0@8+net_drop:holder-2@10"
