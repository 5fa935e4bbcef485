"""The query rows of one decode step, and what each row attends of its own session.

A step feeds every session its pending tokens at once; its rows are those tokens, session by
session. Private rows (a session's prefix and suffix, never the corpus) are scored and attended
here, over each session's own cache; the corpus part is the fan-out's (requester/fanout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from corpusd.kernels.reference import partial_attention
from corpusd.model import ModelConfig
from corpusd.model.mla import Projections
from indexer import index_scores
from requester.session import Session


@dataclass(frozen=True)
class StepRows:
    """The query rows of one step: row ``r`` is a token of ``sessions[sess[r]]`` at private
    index ``priv[r]`` and logical position ``pos[r]``; ``ends[i]`` is session i's private length
    once the step's rows are written."""

    sessions: list[Session]
    sess: torch.Tensor
    priv: torch.Tensor
    pos: torch.Tensor
    offset: torch.Tensor
    ends: list[int]

    @classmethod
    def of(cls, batch: Sequence[tuple[Session, Sequence[int]]]) -> StepRows:
        """The rows of feeding each session its new tokens (reserving room in its cache)."""
        sessions = [s for s, _ in batch]
        assert len({s.id for s in sessions}) == len(sessions), "a session appears twice in a step"
        sess: list[int] = []
        priv: list[int] = []
        ends: list[int] = []
        for i, (s, new) in enumerate(batch):
            assert new, f"session {s.id} has no tokens to feed"
            s.cache.reserve(len(new))
            sess += [i] * len(new)
            priv += range(s.cache.length, s.cache.length + len(new))
            ends.append(s.cache.length + len(new))
        sess_t, priv_t = torch.tensor(sess), torch.tensor(priv)
        pos = torch.cat([s.logical(priv_t[sess_t == i]) for i, s in enumerate(sessions)])
        offset = torch.tensor([s.offset for s in sessions])[sess_t]
        return cls(sessions, sess_t, priv_t, pos, offset, ends)

    def private_scores(
        self, layer: int, proj: Projections, r: torch.Tensor, i: int, c: ModelConfig
    ) -> torch.Tensor:
        """Index scores of step rows ``r`` (all of session ``i``) over that session's keys."""
        keys = self.sessions[i].cache.index_keys[layer][: self.ends[i]]
        return index_scores(
            proj.index_q[r], proj.index_w[r], keys, c.index_head_dim**-0.5, c.index_arith
        )

    def private_partial(
        self, q: torch.Tensor, ridx: torch.Tensor, private: torch.Tensor, layer: int, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's partial over its own session's private rows (logical ``private``)."""
        n, h = q.shape[:2]
        o = q.new_zeros(n, h, c.kv_lora_rank)
        lse = torch.full((n, h), float("-inf"))
        sess = self.sess[ridx]
        for i in sess.unique().tolist():
            m = sess == i
            s = self.sessions[i]
            pidx = torch.where(private[m] >= 0, s.private_index(private[m]), -1)
            o[m], lse[m] = partial_attention(
                q[m], s.cache.latent[layer], pidx, c.softmax_scale, c.kv_lora_rank
            )
        return o, lse
