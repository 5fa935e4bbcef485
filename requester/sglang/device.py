"""The corpus path of an SGLang step on the device: select → route → merge, CUDA-graph safe.

Everything here is tensor operations on fixed shapes with no host synchronisation, so SGLang can
capture it in its decode graphs. What varies per batch lives in preallocated tables that the
graph reads (:class:`CorpusTables`): which request is bound to which corpus, where each corpus's
index keys sit in the arena, and which holder frame holds each page. Tables are written between
steps (at a request's prefill, outside any graph), never reallocated.

Per layer:

1. **Select.** The corpus's index scores (:mod:`.device_scores`: SGLang's own fp8 kernel over
   the corpus's pages in SGLang's index-k page format, a torch reference on CPU) and the
   request's own logits enter one exact top-k (:func:`fused_topk`): score descending in
   SGLang's order (its float32 bits: ``-0.0`` below ``+0.0``), the lowest logical position first
   among exact ties (corpus ``0 … T−1``, own token ``j`` at ``T + j``), as
   :func:`.topk.sglang_topk` over the concatenated row (:mod:`.topk` says why that rule).
2. **Route.** The corpus positions become frame rows of the holders' pools
   (:func:`corpus_rows`); a holder on this GPU has its pool mapped here by CUDA IPC, so the
   sparse partial runs on the worker's stream over the holder's frames: FlashMLA's bf16 sparse
   kernel over plain pools (:func:`sparse_partial`), its fp8 sparse decode over pools of
   FlashMLA's 656-byte fp8 rows (:func:`fp8_partial`), whichever format the holders hold.
3. **Merge** the partials with the request's own by LSE (:func:`.lse.merge_local_corpus`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from corpusd.kernels import flashmla
from corpusd.kernels.formats import FP8
from corpusd.kernels.registry import prefer_triton
from requester.sglang import device_triton
from requester.sglang.resident import Resident
from requester.sglang.topk import sglang_order

INT64_MIN = torch.iinfo(torch.int64).min
#: Key chunks per query row in the sparse partial (:func:`sparse_partial`).
SPLITS = 1
_LOW32 = (1 << 32) - 1


def order_keys(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (score descending, column ascending), one distinct
    key per column; ``INT64_MIN`` where ``valid`` is False or the score is NaN or ``-inf``
    (never a candidate, as in :func:`indexer.select.select_topk`).

    The high 32 bits rank the float32 score as SGLang's NSA top-k does
    (:func:`.topk.sglang_order`: by its raw bits, so ``-0.0`` ranks below ``+0.0``), the low 32
    bits are ``2³² − 1 − column``, so equal bits order by column: at an exact tie the lowest
    column wins, one of the outcomes of SGLang's kernel (:mod:`.topk`'s docstring). ``scores``:
    float ``[n, m]`` with ``m < 2³²``."""
    s = scores.float()
    col = torch.arange(s.shape[1], device=s.device, dtype=torch.int64)
    key = (sglang_order(s) - (1 << 31)) * (1 << 32) + (_LOW32 - col)
    return key.masked_fill(~valid | torch.isnan(s) | (s == -math.inf), INT64_MIN)


def exact_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` best valid scores of each row, ``-1`` padded (int64 ``[n, k]``, in no
    particular order); among equal scores the lowest column wins. One unsorted ``topk`` over
    int64 keys (no host sync)."""
    n, m = scores.shape
    keys = order_keys(scores, valid)
    width = min(k, m)
    top = keys.topk(width, dim=1, sorted=False).values
    col = torch.where(top != INT64_MIN, _LOW32 - (top & _LOW32), -1)
    if width < k:
        col = torch.cat([col, col.new_full((n, k - width), -1)], dim=1)
    return col


def fused_topk(
    corpus_scores: torch.Tensor,
    corpus_len: torch.Tensor,
    own_scores: torch.Tensor,
    own_len: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One exact top-k over a row's corpus and own candidates.

    Args:
        corpus_scores: float ``[n, W_c]``: column ``c`` scores corpus position ``c``; only
            ``c < corpus_len[i]`` is a candidate (the rest may hold garbage).
        corpus_len: int ``[n]``, 0 for an unbound row.
        own_scores: float ``[n, W_o]``: column ``j`` scores the row's own position ``j``, a
            candidate when ``j < own_len[i]``.
        own_len: int ``[n]``.
        k: ``index_topk``.

    Returns:
        ``(corpus positions int64 [n, k], own positions int32 [n, k])``, each ``-1`` in the
        slots the other side took (each keeps width ``k``, as the kernels expect).
    """
    wc = corpus_scores.shape[1]
    wo = own_scores.shape[1]
    if device_triton.usable(corpus_scores):  # the same keys and split, in two kernels
        keys = device_triton.order_keys(corpus_scores, corpus_len, own_scores, own_len)
        top = keys.topk(min(k, wc + wo), dim=1, sorted=False).values
        return device_triton.split_columns(top, k, wc)
    return fused_topk_torch(corpus_scores, corpus_len, own_scores, own_len, k)


def fused_topk_torch(
    corpus_scores: torch.Tensor,
    corpus_len: torch.Tensor,
    own_scores: torch.Tensor,
    own_len: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_topk` in torch ops (the CPU path and the kernels' reference)."""
    wc = corpus_scores.shape[1]
    wo = own_scores.shape[1]
    dev = corpus_scores.device
    cvalid = torch.arange(wc, device=dev)[None, :] < corpus_len.to(dev)[:, None]
    ovalid = torch.arange(wo, device=dev)[None, :] < own_len.to(dev)[:, None]
    scores = torch.cat([corpus_scores.float(), own_scores.float()], dim=1)
    col = exact_topk(scores, torch.cat([cvalid, ovalid], dim=1), k)
    corpus = torch.where((col >= 0) & (col < wc), col, -1)
    own = torch.where(col >= wc, col - wc, -1).to(torch.int32)
    return corpus, own


def corpus_rows(
    positions: torch.Tensor,
    row_base: torch.Tensor,
    page_holder: torch.Tensor,
    page_frame: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corpus positions → (holder slot int32, pool row int32), ``-1`` where unused.

    ``positions [n, k]`` int64 (``-1`` unused); ``row_base [n]`` the arena page of each row's
    corpus page 0; ``page_holder`` / ``page_frame`` int32 ``[arena pages]``: which mapped holder
    pool holds an arena page, in which frame."""
    if device_triton.usable(positions):  # one kernel instead of ~10 ops
        return device_triton.corpus_rows(positions, row_base, page_holder, page_frame, page_size)
    return corpus_rows_torch(positions, row_base, page_holder, page_frame, page_size)


def corpus_rows_torch(
    positions: torch.Tensor,
    row_base: torch.Tensor,
    page_holder: torch.Tensor,
    page_frame: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`corpus_rows` in torch ops (the CPU path and the kernel's reference)."""
    used = positions >= 0
    p = positions.clamp(min=0)
    apage = row_base.to(p.dtype)[:, None] + p // page_size
    apage = apage.clamp(max=page_holder.shape[0] - 1)
    holder = torch.where(used, page_holder[apage], -1)
    row = page_frame[apage].to(torch.int64) * page_size + p % page_size
    return holder.to(torch.int32), torch.where(used & (holder >= 0), row, -1).to(torch.int32)


def empty_lse(n: int, h: int, device: torch.device) -> torch.Tensor:
    return torch.full((n, h), -math.inf, device=device)


# -- the per-layer kernels: SGLang's / FlashMLA's on the GPU, the torch reference elsewhere --------


def sparse_partial(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    d_v: int,
    base2: bool,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of ``q [n, h, d_qk]`` (bf16, corpusd's rope layout) over ``kv [N,
    d_qk]`` rows ``rows [n, k]`` (int32, -1 unused): ``(O [n, h, d_v] float32, LSE [n, h]
    natural, -inf empty)``. The kernel is the registry's per-request choice
    (``corpusd.kernels.registry.prefer_triton``, the rule the holders use): Triton's
    flash-decoding kernel for few rows or heads, or where FlashMLA cannot run; FlashMLA's
    sparse kernel otherwise (``flashmla.split_sparse_partial``: ``splits`` chunks of k per
    row, None takes :data:`SPLITS`, measured by ``tools/bench_device_path.py``; ``base2``: its
    LSE base, probed once by the caller). A given ``splits`` forces FlashMLA.
    :func:`corpusd.kernels.reference.partial_attention` off CUDA."""
    if not q.is_cuda:
        from corpusd.kernels.reference import partial_attention

        return partial_attention(q.float(), kv.float(), rows, scale, d_v)
    n, h, _ = q.shape
    if splits is None and (prefer_triton(n, h) or not flashmla.usable(str(q.device))):
        from corpusd.kernels.triton_mla import triton_partial_attention

        # float32 O: merged with the request's own partial, then rounded once (as stock rounds
        # its one attention), not rounded to bf16 here first
        return triton_partial_attention(q, kv, rows, scale, d_v, out_dtype=torch.float32)
    return flashmla.split_sparse_partial(q, kv, rows, scale, d_v, base2,
                                         SPLITS if splits is None else splits)  # fmt: skip


def fp8_partial(
    q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_partial` over a pool of fp8 rows (uint8 ``[N, 656]``, N whole 64-row
    blocks): ``(O [n, h, d_v] float32, LSE [n, h] natural, -inf empty)``. FlashMLA's fp8 sparse
    decode on CUDA (``corpusd/kernels/flashmla.py``, the holders' own fp8 kernel), whose LSE
    base must have been probed for q's device before any graph capture
    (``flashmla.lse_to_natural(device, fp8=True)``, the entry model does it at start);
    :func:`corpusd.kernels.fp8_cache.fp8_partial_attention` elsewhere."""
    if not q.is_cuda:
        from corpusd.kernels.fp8_cache import fp8_partial_attention

        o, lse = fp8_partial_attention(q.float(), kv, rows, scale, d_v)
        return o, lse
    o, lse = flashmla.fp8_sparse_partial(q, kv, rows, scale, d_v)
    return o.float(), lse


def corpus_partial(
    res: Resident,
    layer: int,
    q: torch.Tensor,
    positions: torch.Tensor,
    base: torch.Tensor,
    scale: float,
    d_v: int,
    base2: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus partial of ``q [n, h, d_qk]`` (bf16, corpusd's rope layout) over each row's
    selected corpus ``positions [n, k]`` (-1 unused): one sparse call per mapped holder over its
    own pool, merged by LSE. ``(O [n, h, d_v] float32, LSE [n, h])``. The pools' row format
    (``res.kv_format``) picks the kernel: :func:`sparse_partial` (``base2``: its LSE base) for
    plain rows, :func:`fp8_partial` for fp8 rows."""
    from requester.sglang.lse import merge_local_corpus

    holder, rows = corpus_rows(positions, base, res.page_holder, res.page_frame, res.page_size)
    n, h, _ = q.shape

    def partial(
        qq: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if res.kv_format == FP8:
            return fp8_partial(qq, kv, idx, scale, d_v)
        return sparse_partial(qq, kv, idx, scale, d_v, base2)

    if res.staged:  # a peer pool mapped: one copy, one kernel call
        return staged_partial([p[layer] for p in res.pools], q, holder, rows, res.stage_rows,
                              partial)  # fmt: skip
    if len(res.pools) == 1:  # every resident page is on this holder (or unused: -1)
        return partial(q, res.pools[0][layer], rows)
    o = torch.zeros(n, h, d_v, device=q.device)
    lse = empty_lse(n, h, q.device)
    for slot, pools in enumerate(res.pools):
        o_s, l_s = partial(q, pools[layer], torch.where(holder == slot, rows, -1))
        o, lse = merge_local_corpus(o, lse, o_s, l_s)
    return o, lse


Partial = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def one_call_partial(
    res: Resident, layer: int, q: torch.Tensor, own_kv: torch.Tensor, own_rows: torch.Tensor,
    positions: torch.Tensor, base: torch.Tensor, scale: float, d_v: int, base2: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The whole attention of ``q [m, h, d]`` (bf16, SGLang's layout) in one kernel call, as
    stock SGLang computes it: each row's top-k list holds, slot by slot, either one of its own
    tokens (``own_rows [m, k]``: rows of SGLang's cache ``own_kv [N, …]``, -1 elsewhere) or a
    corpus position (``positions [n, k]``, n <= m, -1 elsewhere; rows past n have none), the
    two sides of one fused top-k. The corpus rows are copied from the holders' pools with
    their rope band re-interleaved into SGLang's layout, the own rows as they are, into one
    buffer (:func:`staged_partial`, ``res.stage_rows`` query rows a copy, all when 0), and
    FlashMLA attends it once: one softmax over both sides and one rounding of O, where
    :func:`corpus_partial` beside SGLang's own kernel rounds the own part's O before the LSE
    merge. ``(O [m, h, d_v] float32, LSE [m, h])``. Plain (bf16) pools only."""
    assert res.kv_format != FP8, "one_call_partial: plain pools only (fp8 has its own kernel)"
    m, k = own_rows.shape
    holder, rows = corpus_rows(positions, base, res.page_holder, res.page_frame, res.page_size)
    if positions.shape[0] < m:  # the batch's padding rows: nothing from the corpus
        pad = holder.new_full((m - positions.shape[0], k), -1)
        holder, rows = torch.cat([holder, pad]), torch.cat([rows, pad])
    own = own_rows >= 0
    holder = torch.where(own, len(res.pools), holder)
    rows = torch.where(own, own_rows.to(rows.dtype), rows)
    pools = [p[layer] for p in res.pools] + [own_kv.reshape(own_kv.shape[0], -1)]
    to_sglang = sglang_columns(pools[-1].shape[1], q.device)
    cols: list[torch.Tensor | None] = [to_sglang] * len(res.pools) + [None]

    def partial(qq: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> Any:
        # FlashMLA on CUDA, as stock (splits=1 forces it); the reference elsewhere
        return sparse_partial(qq, kv, idx, scale, d_v, base2, splits=1 if qq.is_cuda else None)

    return staged_partial(pools, q, holder, rows, res.stage_rows or m, partial, cols)


def sglang_columns(d: int, dev: torch.device) -> torch.Tensor:
    """The column map (:func:`stage_rows`) that turns a corpusd row ``[d]`` into SGLang's
    layout: the rope band ``[ROPE_START, ROPE_START + ROPE_WIDTH)`` re-interleaved. Made once
    per width and device (its copy to the GPU must not happen inside a graph's capture: the
    eager forwards before SGLang's captures make it)."""
    return _sglang_columns(d, str(dev))


@functools.cache
def _sglang_columns(d: int, dev: str) -> torch.Tensor:
    from requester.sglang.positions import ROPE_START, ROPE_WIDTH, interleave

    cols = torch.arange(d)
    band = slice(ROPE_START, ROPE_START + ROPE_WIDTH)
    cols[band] = interleave(cols[band])
    return cols.to(torch.int32).to(dev)


def staged_partial(
    pools: list[torch.Tensor], q: torch.Tensor, holder: torch.Tensor, rows: torch.Tensor,
    chunk: int, partial: Partial, cols: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`corpus_partial` over several pools, or pools on other GPUs: ``chunk`` query rows
    at a time, every selected row of every pool is copied into one buffer on this GPU
    (:func:`stage_rows`), then one kernel call attends it there. Read in place, a pool split
    over G holders takes G kernel calls over all ``k`` columns each, and a row on another GPU
    crosses NVLink once per CTA that reads it (FlashMLA: one per 64 heads), by loads the kernel
    pipelines for HBM's latency, not the link's; the copy kernel reads each row once, with every
    SM's loads in flight. The buffer is ``chunk · k`` rows (a temporary: one layer at a time)."""
    n = q.shape[0]
    if n == 0:  # nothing to copy: the kernel's empty answer over a pool as it is
        return partial(q, pools[0], rows)
    if n <= chunk:
        kv, idx = stage_rows(pools, holder, rows, cols)
        return partial(q, kv, idx)
    os_, lses = [], []
    for c0 in range(0, n, chunk):
        kv, idx = stage_rows(pools, holder[c0 : c0 + chunk], rows[c0 : c0 + chunk], cols)
        o_c, l_c = partial(q[c0 : c0 + chunk], kv, idx)
        os_.append(o_c)
        lses.append(l_c)
    return torch.cat(os_), torch.cat(lses)


def stage_rows(
    pools: list[torch.Tensor], holder: torch.Tensor, rows: torch.Tensor,
    cols: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every selected row (``holder [n, k]`` slot, ``rows [n, k]`` its pool row, -1 unused) copied
    into one buffer: ``(kv [R, …]`` in the pools' row format, R = ``n · k`` rounded up to 64 rows,
    ``idx`` int32 ``[n, k]``: entry ``(i, j)``'s row ``i · k + j`` of ``kv``, -1 where unused).
    Rows of ``kv`` no entry names are left as they were (``idx`` never points at them).
    ``cols``: per pool None, or a map of its row's elements (``kv``'s element ``w`` is the row's
    element ``cols[w]``; pools ``[N, D]``). One Triton kernel per pool on CUDA
    (:func:`.device_triton.stage_rows`), torch indexing elsewhere (:func:`stage_rows_torch`,
    its reference)."""
    if device_triton.usable(rows):
        return device_triton.stage_rows(pools, holder, rows, cols)
    return stage_rows_torch(pools, holder, rows, cols)


def stage_rows_torch(
    pools: list[torch.Tensor], holder: torch.Tensor, rows: torch.Tensor,
    cols: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`stage_rows` by torch indexing (host-synchronising: not for a CUDA graph)."""
    n, k = rows.shape
    e = n * k
    kv = torch.zeros((-(-e // 64) * 64, *pools[0].shape[1:]), dtype=pools[0].dtype,
                     device=rows.device)  # fmt: skip
    h, r = holder.reshape(-1), rows.reshape(-1).long()
    for slot, pool in enumerate(pools):
        take = ((h == slot) & (r >= 0)).nonzero().squeeze(1)
        got = pool[r[take]].to(kv.device)
        col = None if cols is None else cols[slot]
        kv[take] = got if col is None else got[:, col.long()]
    flat = torch.arange(e, dtype=torch.int32, device=rows.device)
    return kv, torch.where(r >= 0, flat, -1).to(torch.int32).reshape(n, k)
