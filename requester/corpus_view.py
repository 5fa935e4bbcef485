"""A requester's view of one pinned corpus: its length and where each page lives.

The page table maps a corpus page to its replicas ``(holder, frame)``; a pool row on a holder is
``frame * page_size + slot``. The view is built from the holders' own reports (``Info``), so it
is what the holders will accept; one replica per page is chosen to spread pages over replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from requester.holder_client import HolderClient


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

    @property
    def n_pages(self) -> int:
        return int(self.page_holder.shape[0])

    def pool_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical positions (int64, ``-1`` = none) → (holder idx, pool row), ``-1`` for none."""
        valid = positions >= 0
        page = torch.where(valid, positions // self.page_size, 0)
        holder = torch.where(valid, self.page_holder[page], -1)
        row = torch.where(
            valid, self.page_frame[page] * self.page_size + positions % self.page_size, -1
        )
        return holder, row

    @classmethod
    async def from_holders(cls, corpus_id: str, clients: Mapping[str, HolderClient]) -> CorpusView:
        """Ask every holder what it has of ``corpus_id``. Raises CorpusUnavailable."""
        addresses = sorted(clients)
        found: dict[int, list[tuple[int, int]]] = {}
        tokens, page_size = 0, 0
        for hi, addr in enumerate(addresses):
            info = await clients[addr].info()
            for held in info.corpora:
                if held.corpus_id != corpus_id:
                    continue
                tokens, page_size = int(held.tokens), int(info.page_size)
                for pf in held.frames:
                    found.setdefault(int(pf.page), []).append((hi, int(pf.frame)))
        if not found:
            raise CorpusUnavailable(f"corpus {corpus_id!r} is held by none of {addresses}")
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
