"""The fan-out engine's device half (requester/fanout_device.py): the plan a captured device
executor reads. Each page is read from its first replica while that holder lives (never from a
load replica's copy), per holder over the transport it was given; failover re-plans a failed
holder's pages onto their next live replica, and names the pages left with none."""

from __future__ import annotations

import pytest
import torch

from requester.corpus_view import CorpusView
from requester.fanout_device import TRANSPORTS, DevicePlan, NoDeviceTransport, plan_device

P = 64
HOLDERS = ("gpu0:1", "gpu1:1", "gpu2:1")


def _view(
    replicas: list[list[tuple[int, int]]], tokens: int | None = None, pinned: int = 0
) -> CorpusView:
    """A view whose page ``p`` has the (holder index, frame) replicas ``replicas[p]``, the
    placement's first, ``pinned`` of them the pin's (default: all); the view itself routes each
    page to its last replica (as one spread over a load replica would), which the device plan
    must not follow."""
    last = [r[-1] for r in replicas]
    return CorpusView(
        "c0", tokens if tokens is not None else len(replicas) * P, P, HOLDERS,
        torch.tensor([h for h, _ in last]), torch.tensor([f for _, f in last]),
        tuple(tuple(r) for r in replicas), pinned=pinned or max(map(len, replicas)),
    )  # fmt: skip


def test_the_plan_reads_first_replicas_grouped_by_holder_over_their_transport() -> None:
    view = _view([[(0, 5), (1, 0)], [(1, 7)], [(0, 2), (2, 3)], [(2, 9), (0, 1)]], tokens=250)
    plan = plan_device(view, {"gpu0:1": "cuda_ipc", "gpu1:1": "nvshmem", "gpu2:1": "nvshmem"})
    assert plan.n_pages == 4 and plan.tokens == 250 and plan.page_size == P
    assert plan.placement == (("gpu0:1", 5), ("gpu1:1", 7), ("gpu0:1", 2), ("gpu2:1", 9))
    got = {g.address: (g.transport, g.pages, g.frames) for g in plan.groups}
    assert got == {
        "gpu0:1": ("cuda_ipc", (0, 2), (5, 2)),
        "gpu1:1": ("nvshmem", (1,), (7,)),
        "gpu2:1": ("nvshmem", (3,), (9,)),
    }
    assert [g.address for g in plan.groups] == ["gpu0:1", "gpu1:1", "gpu2:1"]  # first page order
    # every replica kept, by address, the placement's first
    assert plan.replicas[0] == (("gpu0:1", 5), ("gpu1:1", 0))


def test_a_page_whose_pin_replicas_are_out_of_reach_is_refused_not_read_from_a_load_copy() -> None:
    """Page 1's one pin replica is on a holder the device path does not reach; its other copy
    on a reachable holder is a load replica, whose frames are released later: refused, naming
    the page and the holders."""
    view = _view([[(0, 0)], [(1, 4), (0, 1)]], pinned=1)
    with pytest.raises(NoDeviceTransport, match=r"pages \[1\] .*gpu0:1', 'gpu1:1'.*reachable"):
        plan_device(view, {"gpu0:1": "cuda_ipc"})
    assert plan_device(view, {"gpu0:1": "cuda_ipc", "gpu1:1": "nvshmem"}).placement[1] == (
        "gpu1:1", 4,
    )  # fmt: skip


def test_a_pin_replica_on_a_reachable_holder_is_read_when_the_first_is_out_of_reach() -> None:
    """Pinned with two replicas, each page has a copy the pin placed on gpu1: a worker that
    reaches gpu1 alone (a data-parallel rank on that GPU, say) reads every page there."""
    view = _view([[(0, 5), (1, 0)], [(1, 7), (0, 2)], [(0, 3), (1, 9), (2, 4)]], pinned=2)
    plan = plan_device(view, {"gpu1:1": "cuda_ipc"})
    assert plan.placement == (("gpu1:1", 0), ("gpu1:1", 7), ("gpu1:1", 9))
    # page 2's copy on gpu2 is its third: a load replica, never read
    with pytest.raises(NoDeviceTransport, match=r"pages \[0, 1, 2\]"):
        plan_device(view, {"gpu2:1": "cuda_ipc"})


def test_failover_moves_a_failed_holders_pages_to_their_next_live_replica() -> None:
    view = _view([[(0, 5), (1, 0)], [(1, 7), (2, 1)], [(0, 2), (2, 3)]])
    every = dict.fromkeys(HOLDERS, "nvshmem") | {"gpu0:1": "cuda_ipc"}
    plan = plan_device(view, every)
    after = plan.failover({"gpu0:1"})
    assert after.dead == {"gpu0:1"} and plan.dead == frozenset()  # the old plan is unchanged
    assert after.placement == (("gpu1:1", 0), ("gpu1:1", 7), ("gpu2:1", 3))
    assert {g.address: g.pages for g in after.groups} == {"gpu1:1": (0, 1), "gpu2:1": (2,)}
    # page 0 lives only on gpu0 and gpu1: with both failed, it is read from gpu0's pool, which
    # its CUDA IPC mapping keeps (RETAINED); gpu1's NVSHMEM pool is not kept
    both = after.failover({"gpu1:1"})
    assert both.kept == {"gpu0:1"} and both.placement[0] == ("gpu0:1", 5)
    assert both.placement[1:] == (("gpu2:1", 1), ("gpu2:1", 3))
    assert both.moved(after) == (1, 1)  # page 1 to gpu2's replica, page 0 to gpu0's kept pool


def test_a_failed_holder_over_nvshmem_leaves_its_only_pages_with_no_route() -> None:
    view = _view([[(0, 5), (1, 0)], [(1, 7), (2, 1)]])
    plan = plan_device(view, dict.fromkeys(HOLDERS, "nvshmem"))
    with pytest.raises(NoDeviceTransport, match=r"pages \[0\].*failed: \['gpu0:1', 'gpu1:1'\]"):
        plan.failover({"gpu0:1", "gpu1:1"})


def test_a_plan_made_after_a_death_never_reads_the_dead_holders_pool() -> None:
    """A holder restarted at a dead one's address serves a new pool; the mapping this process
    kept is the old one. So only corpora planned before the death read it (failover); one
    planned after is refused when a page has no live replica, and reads a replica otherwise."""
    view = _view([[(0, 5), (1, 0)], [(0, 7)]])
    ipc = dict.fromkeys(HOLDERS, "cuda_ipc")
    with pytest.raises(NoDeviceTransport, match=r"pages \[1\].*failed: \['gpu0:1'\]"):
        plan_device(view, ipc, dead={"gpu0:1"})
    assert plan_device(view, ipc).failover({"gpu0:1"}).placement == (
        ("gpu1:1", 0), ("gpu0:1", 7),
    )  # fmt: skip
    later = plan_device(_view([[(0, 5), (1, 0)]]), ipc, dead={"gpu0:1"})
    assert later.placement == (("gpu1:1", 0),) and later.kept == frozenset()


def test_transports_are_the_registered_names() -> None:
    view = _view([[(0, 0)]])
    with pytest.raises(AssertionError, match="not in"):
        plan_device(view, {"gpu0:1": "tcp"})
    assert TRANSPORTS == ("cuda_ipc", "cuda_p2p", "nvshmem")
    assert isinstance(plan_device(view, {"gpu0:1": "cuda_ipc"}), DevicePlan)
