"""The device path's corpus index scores (step 1 of :mod:`.device`, before the fused top-k):
SGLang's own ``fp8_paged_mqa_logits`` (DeepGEMM) over the arena's index-k pages on CUDA,
:func:`paged_scores_reference` elsewhere, and the warm-up that compiles a prefill's JIT kernels
at the server's start."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from requester.sglang.device import fused_topk
from requester.sglang.resident import Resident

_SM_COUNT: dict[int, int] = {}


def paged_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """What SGLang's ``fp8_paged_mqa_logits`` computes, in float32 torch: the index score of
    every row's key ``j`` (page ``block_table[i, j // P]``, slot ``j % P``).

    Args:
        q: ``[n, H, D]`` index queries (float8 e4m3 or float).
        weights: float ``[n, H]`` (SGLang's: head weight · H^-0.5 · q scale · D^-0.5).
        pages: uint8 ``[pages, P · (D + 4)]``: SGLang's index-k pages (P·D fp8 keys, then P
            float32 scales).
        block_table: int32 ``[n, W / P]``.

    Returns:
        float32 ``[n, W]``: ``Σ_h relu(q_h · k_j) · weights_h`` (no masking).
    """
    n, _, d = q.shape
    flat = pages[block_table.long()]  # [n, W/P, P(D+4)]
    keys = flat[..., : page_size * d].contiguous().view(torch.float8_e4m3fn).float()
    keys = keys.reshape(n, -1, d)  # [n, W, D]
    scale = flat[..., page_size * d :].contiguous().view(torch.float32).reshape(n, -1)
    logits = torch.einsum("nhd,nwd->nhw", q.float(), keys).relu()
    return (logits * weights.float()[..., None]).sum(1) * scale


def _deep_gemm() -> Any:
    try:
        import deep_gemm  # SGLang's indexer kernels (sgl_kernel's build)
    except ImportError:
        return None
    return deep_gemm


#: Rows per DeepGEMM scoring call outside a CUDA graph (a prefill, or a decode batch no graph was
#: captured for); the last chunk is padded. DeepGEMM's schedule kernel
#: (``get_paged_mqa_logits_metadata``) is JIT-compiled per batch size rounded up to 32, about 0.9
#: s each on an H200, so prefills of ever new sizes stalled the server at each one (a 64-stream
#: burst: ~2 s per prefill batch, route's first token 4.7 s against stock's 1.1); with one chunk
#: size there is one compile, done at start (:func:`warm_up`).
SCORE_ROWS = 512


def corpus_scores(
    res: Resident, layer: int, q: torch.Tensor, weights: torch.Tensor, base: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Index scores ``[n, window]`` (float32) of each row's corpus: SGLang's
    ``fp8_paged_mqa_logits`` over the arena on CUDA, :func:`paged_scores_reference` elsewhere.
    Columns past a row's corpus length hold garbage (``fused_topk`` masks them). ``q``: the
    indexer's fp8 queries ``[n, H, D]``; ``weights`` ``[n, H]`` or ``[n, H, 1]``. Outside a graph
    capture the rows go in chunks of :data:`SCORE_ROWS`, the last one padded."""
    n = q.shape[0]
    if n == 0:
        return torch.empty(0, res.window_tokens, device=q.device)
    w = weights.reshape(n, -1).float()
    table = res.block_table(base)
    seqlens = tokens.clamp(min=1).to(torch.int32)  # an unbound row scores one masked key
    dg = _deep_gemm() if q.is_cuda else None
    if dg is None:
        return paged_scores_reference(q, w, res.pages[layer], table, res.page_size)

    def score(
        q: torch.Tensor, w: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        return _paged_logits(dg, res, layer, q, w, table, lens)

    if torch.cuda.is_current_stream_capturing():  # a graph's fixed batch: compiled at capture
        return score(q, w, table, seqlens)
    return in_row_chunks(score, SCORE_ROWS, (q, w, table, seqlens), (0, 0.0, 0, 1))


def in_row_chunks(
    fn: Callable[..., torch.Tensor], rows: int, args: tuple[torch.Tensor, ...],
    fill: tuple[float, ...],
) -> torch.Tensor:  # fmt: skip
    """``fn(*args)`` for args that share their first dimension ``n``, computed ``rows`` rows at
    a time with the last chunk padded to ``rows`` (arg ``i`` padded with ``fill[i]``): every call
    sees exactly ``rows`` rows, whatever ``n``. The chunks' outputs (row ``r`` of the output
    belongs to input row ``r``) are concatenated back to ``n`` rows."""
    n = args[0].shape[0]
    out: torch.Tensor | None = None
    for s in range(0, n, rows):
        part = [a[s : s + rows] for a in args]
        m = part[0].shape[0]
        if m < rows:
            part = [
                torch.cat([a, a.new_full((rows - m, *a.shape[1:]), f).to(a.dtype)])
                for a, f in zip(part, fill, strict=True)
            ]
        got = fn(*part)[:m]
        if n <= rows:
            return got
        if out is None:  # one output and one chunk's at a time (a prefill's scores are large)
            out = got.new_empty((n, *got.shape[1:]))
        out[s : s + m] = got
    assert out is not None, "no rows"
    return out


def _paged_logits(
    dg: Any, res: Resident, layer: int, q: torch.Tensor, w: torch.Tensor, table: torch.Tensor,
    seqlens: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    dev = q.device.index or 0
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = int(dg.get_num_sms())
    sched = dg.get_paged_mqa_logits_metadata(seqlens, res.page_size, _SM_COUNT[dev])
    kv = res.pages[layer].view(res.arena_pages, res.page_size, 1, -1)
    return dg.fp8_paged_mqa_logits(
        q[:, None], kv, w, seqlens, table, sched, res.window_tokens, clean_logits=False
    )


def warm_up(res: Resident, device: torch.device, index_topk: int) -> bool:
    """Compile now (at the server's start, outside any graph) what a prefill would otherwise
    compile on the scheduler's thread: DeepGEMM's schedule kernel for :data:`SCORE_ROWS` rows,
    and the fused top-k's Triton kernels for a prefill's own-score widths (Triton specialises
    an integer argument on divisibility by 16: both cases). The decode kernels are compiled by
    SGLang's graph capture. False when DeepGEMM is not there (CPU)."""
    dg = _deep_gemm() if device.type == "cuda" else None
    if dg is None:
        return False
    dev = device.index or 0
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = int(dg.get_num_sms())
    lens = torch.ones(SCORE_ROWS, dtype=torch.int32, device=device)
    dg.get_paged_mqa_logits_metadata(lens, res.page_size, _SM_COUNT[dev])
    # the dtypes of backend.CorpusIndexerMetadata._device_topk's (a pointer's dtype is part of
    # a Triton kernel's signature): the tables' int32 corpus lengths, SGLang's int64 own ones
    corpus_len = torch.ones(1, dtype=torch.int32, device=device)
    own_len = torch.ones(1, dtype=torch.int64, device=device)
    for width in (64, 65):
        scores = torch.zeros(1, res.window_tokens, device=device)
        fused_topk(scores, corpus_len, torch.zeros(1, width, device=device), own_len, index_topk)
    torch.cuda.synchronize(device)
    return True
