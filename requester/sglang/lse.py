"""LSE conventions at the SGLang boundary, and the merge of a local partial with corpusd's.

Three conventions meet here:

- corpusd (``corpusd/kernels/reference.py``, ``merge.py``): natural log, ``[n, h]``, an empty
  row has LSE ``-inf`` and O = 0.
- FlashMLA as SGLang calls it: ``flash_mla_sparse_fwd`` (prefill) returns ``lse [s_q, h_q]`` in
  base 2 in the sglang-kernel builds we target; ``flash_mla_with_kvcache`` (decode) returns
  ``softmax_lse [b, h_q, s_q]`` in natural log. An empty row may come back as ``+inf``.
- SGLang's ``merge_state`` (``layers/attention/merge_state.py`` → ``sgl_kernel.merge_state_v2``
  or ``triton_ops/merge_state.py``): natural log, ``[T, H]``, reads ``+inf`` as empty. Two empty
  inputs give NaN there (``max(-inf, -inf) - ...``), so after it :func:`repair_empty` is needed.
"""

from __future__ import annotations

import math

import torch

from corpusd.kernels.flashmla import to_natural
from corpusd.kernels.merge import merge_partials
from requester.sglang import device_triton

__all__ = [
    "decode_rows",
    "from_merge_state",
    "merge_local_corpus",
    "repair_empty",
    "rows_to_decode",
    "to_merge_state",
    "to_natural",
]


def decode_rows(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA decode layout → rows: ``o [b, s_q, h, d_v]``, ``lse [b, h, s_q]`` →
    ``o [b·s_q, h, d_v]``, ``lse [b·s_q, h]`` (row ``i·s_q + j`` is batch i's j-th query)."""
    b, s_q, h, d_v = o.shape
    assert lse.shape == (b, h, s_q), f"{lse.shape=} vs {o.shape=}"
    return o.reshape(b * s_q, h, d_v), lse.transpose(1, 2).reshape(b * s_q, h)


def rows_to_decode(lse: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`decode_rows` for the LSE: ``[b·s_q, h]`` → ``[b, h, s_q]``."""
    n, h = lse.shape
    assert n % b == 0, f"{n=} rows do not split into {b=} batches"
    return lse.reshape(b, n // b, h).transpose(1, 2).contiguous()


def to_merge_state(lse: torch.Tensor) -> torch.Tensor:
    """corpusd's empty (``-inf``) → merge_state's empty (``+inf``). Both are read as empty by
    merge_state; ``+inf`` is its documented sentinel, so hand it that."""
    return torch.where(lse == -math.inf, math.inf, lse.float())


def from_merge_state(lse: torch.Tensor) -> torch.Tensor:
    """merge_state's LSE back to corpusd's: ``+inf``/NaN → ``-inf``."""
    return to_natural(lse, base2=False)


def repair_empty(
    o: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows empty in every input (``empty [n, h]`` bool) get O = 0 and LSE = -inf; merge_state
    leaves NaN there."""
    return o.masked_fill(empty[..., None], 0.0), lse.float().masked_fill(empty, -math.inf)


def merge_local_corpus(
    o_local: torch.Tensor,
    lse_local: torch.Tensor,
    o_corpus: torch.Tensor,
    lse_corpus: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of the request's own partial with the corpus partial (both natural log,
    ``-inf`` empty; O ``[n, h, d_v]``, LSE ``[n, h]``): ``corpusd.kernels.merge.merge_partials``
    of the two, in one fused Triton kernel where it runs (``device_triton.merge``, tested
    against it). Returns O in ``o_local.dtype`` and float32 LSE."""
    assert o_local.shape == o_corpus.shape, f"{o_local.shape=} vs {o_corpus.shape=}"
    assert lse_local.shape == lse_corpus.shape == o_local.shape[:2], (
        f"{lse_local.shape=} {lse_corpus.shape=} vs {o_local.shape=}"
    )
    if device_triton.usable(o_local):  # one kernel instead of ~10 ops
        return device_triton.merge(o_local, lse_local, o_corpus, lse_corpus)
    return merge_partials([(o_local, lse_local), (o_corpus, lse_corpus)])
