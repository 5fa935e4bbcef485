"""GetPageTable reads a corpus's row, then its page table: two reads. An unpin between them
left the row ready and the table empty, and the coordinator served that empty table as the
ready corpus's (the HA test's watcher saw ``PARTIAL ()`` once in CI). It now reads both again
and answers NOT_FOUND (gone) or FAILED_PRECONDITION (changed), never a table with pages
missing."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc
import pytest

from corpusd.coordinator.service import CoordinatorService
from corpusd.coordinator.state_store import CorpusRow
from corpusd.rpc import Reject
from corpusd.v1 import coordinator_pb2 as pb

ROW = CorpusRow("c0ffee", "repo", "ready", "{}", 128, 2, 1, 1, None, None, 0.0)
TABLE = {0: [("h1", 0)], 1: [("h1", 1)]}


class _State:
    """The row as first read; what the unpin leaves for every later read."""

    def __init__(self, after: CorpusRow | None) -> None:
        self.rows = [ROW, after]
        self.tables: list[dict[int, list[tuple[str, int]]]] = [{}, {}]

    async def corpus(self, cid: str) -> CorpusRow | None:
        return self.rows.pop(0) if len(self.rows) > 1 else self.rows[0]

    async def page_table(self, cid: str) -> dict[int, list[tuple[str, int]]]:
        return self.tables.pop(0) if len(self.tables) > 1 else self.tables[0]


def _get(state: _State) -> Any:
    svc = CoordinatorService.__new__(CoordinatorService)
    svc.state = state  # type: ignore[assignment]
    return asyncio.run(
        CoordinatorService.GetPageTable.__wrapped__(  # type: ignore[attr-defined]
            svc, pb.GetPageTableRequest(corpus_id=ROW.corpus_id), None
        )
    )


@pytest.mark.parametrize(
    ("after", "code"),
    [
        (None, grpc.StatusCode.NOT_FOUND),
        (replace(ROW, state="pinning"), grpc.StatusCode.FAILED_PRECONDITION),
    ],
    ids=["unpinned", "re-pinning"],
)
def test_a_table_read_across_an_unpin_is_refused_not_served_empty(
    after: CorpusRow | None, code: grpc.StatusCode
) -> None:
    with pytest.raises(Reject) as e:
        _get(_State(after))
    assert e.value.code == code, e.value
