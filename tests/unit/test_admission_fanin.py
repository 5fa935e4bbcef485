"""The fan-in a holder reports with each heartbeat (``Admission.mean_fanin``) is time-averaged:
one instant's count reads 0 whenever a half-busy holder happens to be between flows, and the
leader, reading 0 at every beat of a window, removed a load replica under unchanged load
(bench_fanin). A fake clock makes the averages exact."""

from __future__ import annotations

import asyncio

import pytest

from holder import admission
from holder.admission import Admission


def test_mean_fanin_is_time_averaged_where_one_instant_reads_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    a = Admission(max_flows=1, max_queue=8, queue_timeout_s=30)

    async def go() -> None:
        for _ in range(5):  # busy 0.1 s of every 0.2 s
            async with a.slot():
                now[0] += 0.1
            now[0] += 0.1
        assert a.active + a.queued == 0  # what an instant's sample reads now
        assert a.mean_fanin() == pytest.approx(0.5)

        go_on = asyncio.Event()

        async def first() -> None:
            async with a.slot():
                await go_on.wait()
                now[0] += 0.1  # two flows: one running, one queued

        async def second() -> None:
            async with a.slot():  # handed the slot when first leaves
                now[0] += 0.1  # one flow

        t1 = asyncio.create_task(first())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(second())
        await asyncio.sleep(0)
        assert (a.active, a.queued) == (1, 1)
        go_on.set()
        await asyncio.gather(t1, t2)
        assert a.mean_fanin() == pytest.approx((2 * 0.1 + 1 * 0.1) / 0.2)
        assert a.mean_fanin() == 0.0  # no time since: the instant's count, idle

    asyncio.run(go())
