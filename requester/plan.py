"""A fan-out plan's arithmetic, apart from its I/O: the model's geometry, rows grouped by the
holder of each selected position, and the exact merge of the groups' partials.

``rows`` are pool rows on one holder (``frame * page_size + slot``, int32); ``canon`` are
canonical corpus positions (int64, the corpus's first token at 0); -1 marks an unused slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from corpusd.kernels.merge import merge_partials
from corpusd.kernels.reference import PartialOut
from corpusd.model import DeepseekV32, ModelConfig
from corpusd.model.rope import shift_band
from corpusd.rpc import StatusError
from requester.corpus_view import CorpusView
from requester.predicate import Group

Shift = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # Rotary.shift


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the fan-out needs of the model: widths, the indexer's shape, the cache dtype, and
    ``shift`` (``Rotary.shift``) for corpora placed at an offset (None: offset 0 only)."""

    heads: int
    kv_dim: int  # latent row: kv_lora_rank + qk_rope_head_dim
    d_v: int  # kv_lora_rank: O's width, where the rope band starts
    index_dim: int
    index_topk: int
    index_arith: str
    softmax_scale: float
    dtype: torch.dtype
    shift: Shift | None = None

    @classmethod
    def of_config(cls, c: ModelConfig, dtype: torch.dtype, shift: Shift | None = None) -> Geometry:
        return cls(
            heads=c.num_attention_heads,
            kv_dim=c.kv_dim,
            d_v=c.kv_lora_rank,
            index_dim=c.index_head_dim,
            index_topk=c.index_topk,
            index_arith=c.index_arith,
            softmax_scale=c.softmax_scale,
            dtype=dtype,
            shift=shift,
        )

    @classmethod
    def of(cls, model: DeepseekV32) -> Geometry:
        """The model's geometry, its parameters' dtype, and its rotary shift."""
        return cls.of_config(model.cfg, next(model.parameters()).dtype, model.rotary.shift)

    @property
    def rope_dim(self) -> int:
        return self.kv_dim - self.d_v

    def canonical(self, x: torch.Tensor, offsets: torch.Tensor, start: int) -> torch.Tensor:
        """``x`` with the rope band at ``start`` rotated back by each row's corpus offset, so a
        query at logical position ``p`` scores canonical rows as at ``p − offset``."""
        if not bool((offsets != 0).any()):
            return x
        assert self.shift is not None, "a corpus at an offset needs the model's rotary shift"
        cos, sin = self.shift(-offsets)
        return shift_band(x, start, self.rope_dim, cos, sin)


@dataclass(frozen=True)
class GroupWork:
    """The rows of one call bound for one holder (``address``, index ``holder`` in the view
    they were grouped under): ``keep`` are row numbers within the call's rows; ``rows`` (int32)
    / ``canon`` (int64) ``[len(keep), k_h]`` pool rows / canonical positions, -1 unused."""

    holder: int
    address: str
    keep: torch.Tensor
    rows: torch.Tensor
    canon: torch.Tensor


def group_shape(
    g: GroupWork,
    heads: int,
    kv_dim: int,
    d_v: int,
    *,
    missing_pages: int,
    page_bytes: int,
    missing_tokens: int = 0,
    local_ok: bool = False,
    fetch_ok: bool = True,
) -> Group:
    """What the predicate weighs of group ``g`` (:class:`requester.predicate.Group`): its rows
    and selections, ``heads`` query heads, and what fetch (``missing_pages`` of ``page_bytes``
    each, ``fetch_ok``: they fit where fetched pages are kept) or local (``missing_tokens`` to
    re-prefill, ``local_ok``: possible at all) would still have to bring in."""
    return Group(
        n=len(g.keep), k=int(g.canon.shape[1]), h=heads, rows=int((g.canon >= 0).sum()),
        missing_pages=missing_pages, page_bytes=page_bytes, missing_tokens=missing_tokens,
        local_ok=local_ok, kv_dim=kv_dim, d_v=d_v, fetch_ok=fetch_ok,
    )  # fmt: skip


def compact(mask: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rows of ``mask [m, k]`` with any True, and each value's True entries moved to the front
    (``-1`` after), trimmed to the widest row."""
    keep = mask.any(dim=1).nonzero().squeeze(1)
    mk = mask[keep]
    order = (~mk).to(torch.int8).argsort(dim=1, stable=True)
    mk = mk.gather(1, order)
    width = int(mk.sum(dim=1).max()) if keep.numel() else 0
    out = [torch.where(mk, v[keep].gather(1, order), -1)[:, :width] for v in values]
    return keep, out


def holder_groups(view: CorpusView, canon: torch.Tensor) -> list[GroupWork]:
    """The rows of canonical positions ``canon [n, k]`` (-1 unused) grouped by the holder of
    each position's page under ``view``."""
    holder, rows = view.pool_rows(canon)
    groups = []
    for hi in holder.unique().tolist():
        if hi >= 0:
            keep, (pr, cn) = compact(holder == hi, rows, canon)
            groups.append(GroupWork(hi, view.holders[hi], keep, pr, cn))
    return groups


def merge_groups(
    q: torch.Tensor,
    d_v: int,
    groups: Sequence[GroupWork],
    results: Sequence[PartialOut],
    dtype: torch.dtype | None = None,
) -> PartialOut:
    """The exact merge of each group's ``(O, LSE)`` over its rows: ``(O [n, h, d_v]`` in
    ``dtype`` (default ``q``'s) on ``q``'s device, ``LSE [n, h])``; rows no group served are
    empty (O 0, LSE -inf)."""
    n, h = q.shape[:2]
    like = q.new_zeros(0, dtype=dtype or q.dtype)
    empty = torch.full((n, h), float("-inf"), device=q.device)
    parts = [(like.new_zeros(n, h, d_v), empty)]
    for g, (o_g, lse_g) in zip(groups, results, strict=True):
        o, lse = like.new_zeros(n, h, d_v), empty.clone()
        keep = g.keep.to(q.device)
        assert o_g.shape == (len(keep), h, d_v), (
            f"{g.address}: O {list(o_g.shape)} for {len(keep)} rows, {h} heads, d_v {d_v}"
        )
        o[keep], lse[keep] = o_g.to(like), lse_g.to(lse)
        parts.append((o, lse))
    return merge_partials(parts)


def failure(e: grpc.aio.AioRpcError | StatusError) -> tuple[grpc.StatusCode, str]:
    """The status and message of a failed holder call, whichever transport it went over."""
    if isinstance(e, StatusError):
        return e.code, e.detail
    return e.code(), e.details() or ""
