"""A requester's view of one pinned corpus: its length and where each page lives.

The page table maps a corpus page to its replicas ``(holder, frame)``; a pool row on a holder is
``frame * page_size + slot``. The view is built from the holders' own reports (``Info``), so it
is what the holders will accept; one replica per page is chosen to spread pages over replicas:
page ``p`` to its ``p mod n``-th live replica, or, once the requester has measured its holders
(``reweighted``, :mod:`requester.balance`), to the replica that keeps every holder's share of
pages closest to its measured speed, so a slower copy does not hold back every fork-join call.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch

from corpusd.coordinator.client import PageTable
from requester.holder_client import HolderClient

log = logging.getLogger("corpusd.requester")
INFO_TIMEOUT_S = 5.0  # a holder asked what it holds (a stopped one must not hang a bind)


class CorpusUnavailable(LookupError):
    """The corpus is unknown to the holders, or some of its pages are held nowhere."""


@dataclass(frozen=True)
class CorpusView:
    """``holders[page_holder[p]]`` holds page ``p`` in frame ``page_frame[p]``."""

    corpus_id: str
    token_count: int
    page_size: int
    holders: tuple[str, ...]
    page_holder: torch.Tensor  # int64 [n_pages]
    page_frame: torch.Tensor  # int64 [n_pages]
    replicas: tuple[tuple[tuple[int, int], ...], ...]  # per page: every (holder idx, frame)
    # relative speed per holder idx (rows/s, any scale), None: page p → replica p mod n
    weights: tuple[float, ...] | None = None
    excluded: frozenset[int] = frozenset()  # holders the chosen replicas avoid (failover's dead)
    # each page's first ``pinned`` replicas are the pin's own (kept while it is pinned; the
    # coordinator appends load replicas after them, releasing those later); 0: not known
    pinned: int = 0

    @property
    def n_pages(self) -> int:
        return int(self.page_holder.shape[0])

    def pool_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical positions (int64, ``-1`` = none) → (holder idx int64, pool row int32),
        ``-1`` for none. Pool rows are int32 from here to the holder's kernel (what FlashMLA and
        Triton index with); a holder's pool is far below 2³¹ rows."""
        valid = positions >= 0
        page = torch.where(valid, positions // self.page_size, 0)
        holder = torch.where(valid, self.page_holder[page], -1)
        row = self.page_frame[page] * self.page_size + positions % self.page_size
        return holder, torch.where(valid, row, -1).to(torch.int32)

    def failover(self, dead: Collection[int]) -> CorpusView:
        """The same corpus with every page served by a replica on a holder not in ``dead``.
        Raises CorpusUnavailable naming the pages that have no such replica."""
        chosen: list[tuple[int, int]] = []
        lost, shared = [], []
        load = [0.0] * len(self.holders)
        for p, reps in enumerate(self.replicas):
            live = [r for r in reps if r[0] not in dead]
            if not live:
                lost.append(p)
                live = [(-1, -1)]
            elif self.weights is not None and len(live) > 1:
                shared.append((p, live))  # placed below, once the single copies are counted
            else:
                load[live[p % len(live)][0]] += 1
            chosen.append(live[p % len(live)])
        if lost:
            gone = sorted({self.holders[h] for h in dead})
            raise CorpusUnavailable(
                f"corpus {self.corpus_id}: pages {lost[:8]} (of {self.n_pages}) have no replica "
                f"outside the failed holders {gone}"
            )
        if self.weights is not None:
            w = [max(x, 1e-9) for x in self.weights]
            for p, live in shared:  # the copy whose holder then finishes its pages first
                j = min(
                    range(len(live)),
                    key=lambda j: ((load[live[j][0]] + 1) / w[live[j][0]], (j - p) % len(live)),
                )
                chosen[p] = live[j]
                load[live[j][0]] += 1
        return replace(
            self,
            page_holder=torch.tensor([h for h, _ in chosen], dtype=torch.int64),
            page_frame=torch.tensor([f for _, f in chosen], dtype=torch.int64),
            excluded=frozenset(dead),
        )

    def reweighted(self, weights: tuple[float, ...] | None) -> CorpusView:
        """This view with pages spread by holder speeds ``weights`` (per holder idx; None: by
        page number), still avoiding the holders it avoids."""
        if weights is not None and len(weights) != len(self.holders):
            raise ValueError(f"{len(weights)} weights for {len(self.holders)} holders")
        return replace(self, weights=weights).failover(self.excluded)

    def shared_pages(self) -> bool:
        """Whether some page has more than one replica (only then do weights change anything)."""
        return any(len(r) > 1 for r in self.replicas)

    def same_table(self, other: CorpusView) -> bool:
        """Whether both views come from the same page table: the same holders and every page's
        replicas (the chosen replica may differ: failover picks another)."""
        return self.holders == other.holders and self.replicas == other.replicas

    def without(self, failed: Collection[str]) -> tuple[CorpusView, set[int]]:
        """This view with the holders at addresses ``failed`` marked failed: (the view, their
        indices). Their pages go to other replicas when every page has one; else the view is
        kept and the caller serves the rest another way (a binding recomputes them locally)."""
        dead = {i for i, a in enumerate(self.holders) if a in failed}
        if dead:
            try:
                return self.failover(dead), dead
            except CorpusUnavailable:
                pass
        return self, dead

    @classmethod
    def from_page_table(cls, table: PageTable) -> CorpusView:
        """The coordinator's page table; replicas on holders whose lease lapsed are kept (they
        may answer) but a live replica is chosen first. Raises CorpusUnavailable."""
        c = table.corpus
        if c.state != "ready":
            raise CorpusUnavailable(f"corpus {c.corpus_id} is {c.state}, not ready")
        ids = sorted({h for reps in table.pages for h, _ in reps})
        index = {h: i for i, h in enumerate(ids)}
        reps = tuple(tuple((index[h], f) for h, f in page) for page in table.pages)
        view = cls(
            corpus_id=c.corpus_id,
            token_count=c.tokens,
            page_size=c.page_size,
            holders=tuple(table.address(h) for h in ids),
            page_holder=torch.zeros(len(reps), dtype=torch.int64),
            page_frame=torch.zeros(len(reps), dtype=torch.int64),
            replicas=reps,
            pinned=c.replicas,
        )
        expired = {index[h] for h in ids if not table.holders[h].live}
        try:
            return view.failover(expired)
        except CorpusUnavailable:
            return view.failover(())

    @classmethod
    async def from_holders(cls, corpus_id: str, clients: Mapping[str, HolderClient]) -> CorpusView:
        """Ask every holder what it has of ``corpus_id``; one that does not answer holds
        nothing (its pages may be on others). Raises CorpusUnavailable."""
        answers: dict[str, Any] = {}
        for addr in sorted(clients):
            try:
                answers[addr] = await clients[addr].info(timeout=INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("holder %s did not answer (%s): skipped", addr, e.code().name)
        addresses = sorted(answers)
        found: dict[int, list[tuple[int, int]]] = {}
        tokens, page_size = 0, 0
        for hi, addr in enumerate(addresses):
            info = answers[addr]
            for held in info.corpora:
                if held.corpus_id != corpus_id:
                    continue
                tokens, page_size = int(held.tokens), int(info.page_size)
                for pf in held.frames:
                    found.setdefault(int(pf.page), []).append((hi, int(pf.frame)))
        if not found:
            raise CorpusUnavailable(f"corpus {corpus_id!r} is held by none of {sorted(clients)}")
        n_pages = -(-tokens // page_size)
        missing = [p for p in range(n_pages) if p not in found]
        if missing:
            raise CorpusUnavailable(
                f"corpus {corpus_id} pages {missing[:8]} (of {n_pages}) are held nowhere"
            )
        reps = tuple(tuple(found[p]) for p in range(n_pages))
        chosen = [reps[p][p % len(reps[p])] for p in range(n_pages)]  # spread over replicas
        return cls(
            corpus_id=corpus_id,
            token_count=tokens,
            page_size=page_size,
            holders=tuple(addresses),
            page_holder=torch.tensor([h for h, _ in chosen], dtype=torch.int64),
            page_frame=torch.tensor([f for _, f in chosen], dtype=torch.int64),
            replicas=reps,
        )
