"""The device path's small per-layer ops as single Triton kernels (CUDA; the CPU tests run them in
Triton's interpreter against the torch code they replace).

At decode shapes (8 rows of a few thousand candidates) each torch op of the corpus path costs a
kernel launch's 2–4 µs inside the graph, and the path had ~30 of them: building the top-k's
int64 order keys took 29 µs of the top-k's 90, mapping positions to holder frames and the LSE
merge another ~50 (``tools/bench_device_path.py --variants``). Here each of those steps is one
kernel; the arithmetic is the torch code's, element for element:

- :func:`order_keys`: ``device.fused_topk``'s concatenation, validity masks and
  ``device.order_keys`` (score's order bits high, ``2³² − 1 − column`` low, ``INT64_MIN`` for a
  non-candidate);
- :func:`split_columns`: the chosen keys back to corpus positions and own positions;
- :func:`corpus_rows`: ``device.corpus_rows``;
- :func:`merge`: ``corpusd.kernels.merge.merge_partials`` of two partials, the kernel of
  ``corpusd/kernels/merge_triton.py`` (shared with corpusd's own worker);
- :func:`stage_rows`: ``device.stage_rows_torch``, a copy, bit for bit (no arithmetic).
"""

from __future__ import annotations

import torch

from corpusd.kernels.merge_triton import merge2 as merge
from corpusd.kernels.merge_triton import usable

__all__ = ["corpus_rows", "merge", "order_keys", "split_columns", "stage_rows", "usable"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: device.py keeps its torch ops
    triton = None

_BLOCK = 1024


if triton is not None:

    @triton.jit
    def _keys_kernel(
        cs_ptr, clen_ptr, os_ptr, olen_ptr, key_ptr, wc, wo, s_c, s_o, s_k,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_c = col < wc
        in_o = (col >= wc) & (col < wc + wo)
        clen = tl.load(clen_ptr + row).to(tl.int64)
        olen = tl.load(olen_ptr + row).to(tl.int64)
        sc = tl.load(cs_ptr + row * s_c + col, mask=in_c, other=0.0).to(tl.float32)
        so = tl.load(os_ptr + row * s_o + (col - wc), mask=in_o, other=0.0).to(tl.float32)
        s = tl.where(in_c, sc, so)  # raw bits: -0.0 ranks below +0.0, as SGLang's top-k
        valid = (in_c & (col < clen)) | (in_o & (col - wc < olen))
        bits = s.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.where(bits >= 0, bits + 2147483648, ~bits)
        key = (ordered - 2147483648) * 4294967296 + (4294967295 - col.to(tl.int64))
        bad = (~valid) | (s != s) | (s == float("-inf"))
        key = tl.where(bad, -9223372036854775808, key)
        tl.store(key_ptr + row * s_k + col, key, mask=col < wc + wo)

    @triton.jit
    def _split_kernel(top_ptr, cout_ptr, oout_ptr, width, k, wc, s_t, s_c, s_o,
                      BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        top = tl.load(top_ptr + row * s_t + j, mask=j < width, other=-9223372036854775808)
        col = tl.where(top != -9223372036854775808, 4294967295 - (top & 4294967295), -1)
        corpus = tl.where((col >= 0) & (col < wc), col, -1)
        own = tl.where(col >= wc, col - wc, -1)
        tl.store(cout_ptr + row * s_c + j, corpus, mask=j < k)
        tl.store(oout_ptr + row * s_o + j, own.to(tl.int32), mask=j < k)

    @triton.jit
    def _rows_kernel(
        pos_ptr, base_ptr, holder_ptr, frame_ptr, hout_ptr, rout_ptr, k, n_pages, page_size,
        s_p, s_h, s_r, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < k
        p = tl.load(pos_ptr + row * s_p + j, mask=m, other=-1).to(tl.int64)
        used = p >= 0
        p = tl.maximum(p, 0)
        apage = tl.load(base_ptr + row).to(tl.int64) + p // page_size
        apage = tl.minimum(apage, n_pages - 1)
        holder = tl.load(holder_ptr + apage, mask=m, other=-1)
        holder = tl.where(used, holder, -1)
        frame = tl.load(frame_ptr + apage, mask=m, other=0).to(tl.int64)
        r = tl.where(used & (holder >= 0), frame * page_size + p % page_size, -1)
        tl.store(hout_ptr + row * s_h + j, holder.to(tl.int32), mask=m)
        tl.store(rout_ptr + row * s_r + j, r.to(tl.int32), mask=m)

    @triton.jit
    def _stage_kernel(
        pool_ptr, holder_ptr, rows_ptr, out_ptr, idx_ptr, cols_ptr, slot, n_entries, words,
        WRITE_IDX: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        m = e < n_entries
        h = tl.load(holder_ptr + e, mask=m, other=-1)
        r = tl.load(rows_ptr + e, mask=m, other=-1).to(tl.int64)
        if WRITE_IDX:  # the first pool's launch writes every entry's index
            tl.store(idx_ptr + e, tl.where(r >= 0, e, -1).to(tl.int32), mask=m)
        take = m & (h == slot) & (r >= 0)
        w = tl.arange(0, BLOCK_W)
        mask = take[:, None] & (w < words)[None, :]
        if HAS_MAP:  # output element w is the row's element cols[w]
            src = tl.load(cols_ptr + w, mask=w < words, other=0).to(tl.int64)
        else:
            src = w.to(tl.int64)
        v = tl.load(pool_ptr + r[:, None] * words + src[None, :], mask=mask)
        tl.store(out_ptr + e.to(tl.int64)[:, None] * words + w[None, :], v, mask=mask)


_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # by size in bytes


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous rows) viewed as rows of the widest integer word its row bytes divide."""
    row = t.shape[1:].numel() * t.element_size()
    size = next(size for size in _INT if row % size == 0)
    return t.reshape(t.shape[0], -1).view(torch.uint8).view(_INT[size])


def _elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous rows) viewed as rows of integers of its element's size (a copy by
    element, for a column map)."""
    return t.reshape(t.shape[0], -1).view(_INT[t.element_size()])


def stage_rows(
    pools: list[torch.Tensor], holder: torch.Tensor, rows: torch.Tensor,
    cols: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``device.stage_rows`` in one kernel launch per pool, each copying its own rows only:
    by the widest word the row divides, or element by element through the pool's column map."""
    n, k = rows.shape
    e = n * k
    ref = pools[0]
    kv = torch.empty((-(-e // 64) * 64, *ref.shape[1:]), dtype=ref.dtype, device=rows.device)
    idx = torch.empty(n, k, dtype=torch.int32, device=rows.device)
    if not e:
        return kv, idx
    h = holder.contiguous()
    r = rows.contiguous()
    for slot, pool in enumerate(pools):
        col = None if cols is None else cols[slot]
        src, out = (_words(pool), _words(kv)) if col is None else (_elements(pool), _elements(kv))
        words = out.shape[1]
        block_w = triton.next_power_of_2(words)
        block_e = max(1, 2048 // block_w)
        _stage_kernel[(triton.cdiv(e, block_e),)](
            src, h, r, out, idx, idx if col is None else col.to(torch.int32).contiguous(), slot,
            e, words, WRITE_IDX=slot == 0, HAS_MAP=col is not None, BLOCK_E=block_e,
            BLOCK_W=block_w,
        )  # fmt: skip
    return kv, idx


def order_keys(
    corpus_scores: torch.Tensor, corpus_len: torch.Tensor, own_scores: torch.Tensor,
    own_len: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """int64 ``[n, W_c + W_o]``: ``device.order_keys`` of the concatenated rows, with corpus
    column ``c`` a candidate when ``c < corpus_len`` and own column ``j`` when ``j < own_len``."""
    n, wc = corpus_scores.shape
    wo = own_scores.shape[1]
    cs = corpus_scores if corpus_scores.stride(-1) == 1 else corpus_scores.contiguous()
    os_ = own_scores if own_scores.stride(-1) == 1 else own_scores.contiguous()
    keys = torch.empty(n, wc + wo, dtype=torch.int64, device=cs.device)
    if n and wc + wo:
        clen = corpus_len.to(cs.device).contiguous()
        olen = own_len.to(cs.device).contiguous()
        _keys_kernel[(n, triton.cdiv(wc + wo, _BLOCK))](
            cs, clen, os_, olen, keys, wc, wo, cs.stride(0), os_.stride(0), keys.stride(0),
            BLOCK=_BLOCK,
        )  # fmt: skip
    return keys


def split_columns(top: torch.Tensor, k: int, wc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top [n, width]`` keys (width <= k) → (corpus positions int64 ``[n, k]``, own
    positions int32 ``[n, k]``), ``-1`` where the other side (or nothing) took the slot."""
    n, width = top.shape
    top = top if top.stride(-1) == 1 else top.contiguous()
    corpus = torch.empty(n, k, dtype=torch.int64, device=top.device)
    own = torch.empty(n, k, dtype=torch.int32, device=top.device)
    if n and k:
        _split_kernel[(n, triton.cdiv(k, _BLOCK))](
            top, corpus, own, width, k, wc, top.stride(0), corpus.stride(0), own.stride(0),
            BLOCK=_BLOCK,
        )  # fmt: skip
    return corpus, own


def corpus_rows(
    positions: torch.Tensor, row_base: torch.Tensor, page_holder: torch.Tensor,
    page_frame: torch.Tensor, page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``device.corpus_rows`` in one kernel: (holder slot int32, pool row int32 ``[n, k]``)."""
    n, k = positions.shape
    pos = positions if positions.stride(-1) == 1 else positions.contiguous()
    holder = torch.empty(n, k, dtype=torch.int32, device=pos.device)
    rows = torch.empty(n, k, dtype=torch.int32, device=pos.device)
    if n and k:
        _rows_kernel[(n, triton.cdiv(k, _BLOCK))](
            pos, row_base.contiguous(), page_holder.contiguous(), page_frame.contiguous(),
            holder, rows, k, page_holder.shape[0], page_size,
            pos.stride(0), holder.stride(0), rows.stride(0), BLOCK=_BLOCK,
        )  # fmt: skip
    return holder, rows
