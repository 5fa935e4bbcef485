"""Partial attention over a subset of latent cache rows in torch: the ``torch`` kernel.

This is the reference every other kernel is tested against; a CPU holder serves it for its
frames and the model uses it for its own attention, so prefill, decode and routing share one
definition. Its result, ``(O, LSE)``, is a :data:`PartialOut`.
"""

from __future__ import annotations

import torch

#: A kernel's result: (O ``[n, h, d_v]``, LSE ``[n, h]`` float32, natural log; an empty row has
#: O = 0 and LSE = -inf). Merged exactly by :func:`corpusd.kernels.merge.merge_partials`.
PartialOut = tuple[torch.Tensor, torch.Tensor]

_GATHER_ELEMS = 4 << 20  # float32 elements of one gathered block (16 MiB)


def partial_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    """Absorbed-MLA attention of every row over its own selected cache rows.

    Args:
        q: ``[n, h, d_qk]`` absorbed queries (``q_nope·W_UK ‖ q_pe``; d_qk = 576 for V3.2).
        kv: ``[N, d_qk]`` cache rows (``c_KV ‖ k_pe``); the first ``d_v`` columns are the values.
        indices: int32 or int64 ``[n, k]`` row numbers into ``kv`` (indexed as given, never
            widened); ``-1`` marks an unused slot.
        scale: softmax scale applied to ``q·kv``.
        d_v: value width (512 = kv_lora_rank).

    Returns:
        ``(O, LSE)``: O ``[n, h, d_v]`` in ``q.dtype`` (float32 math inside), LSE float32
        ``[n, h]`` in natural log. A row with no valid index has O = 0 and LSE = -inf.

    Raises:
        IndexError: an index ``>= N``.
    """
    n, h, d = q.shape
    assert kv.dim() == 2 and kv.shape[1] == d, f"{kv.shape=} vs {q.shape=}"
    assert indices.dim() == 2 and indices.shape[0] == n, f"{indices.shape=} vs {q.shape=}"
    if indices.numel() and int(indices.max()) >= kv.shape[0]:
        raise IndexError(f"index {int(indices.max())} out of range for {kv.shape[0]} cache rows")
    # Rows go in blocks so the gathered [block, k, d] rows stay ~16 MiB (in this CPU's L3)
    # whatever n·k is; the score block is updated in place (a pass fewer per op).
    step = max(1, _GATHER_ELEMS // max(1, indices.shape[1] * d))
    o = torch.empty(n, h, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    for i in range(0, n, step):
        ind = indices[i : i + step]
        rows = kv[ind.clamp(min=0)].float()  # [b, k, d]
        s = torch.bmm(q[i : i + step].float(), rows.transpose(1, 2))  # [b, h, k]
        s.mul_(scale).masked_fill_((ind < 0)[:, None, :], float("-inf"))
        part = torch.logsumexp(s, dim=-1)  # [b, h]; -inf for empty rows
        s.sub_(torch.where(torch.isinf(part), 0.0, part)[..., None]).exp_()
        o[i : i + step] = torch.bmm(s, rows[..., :d_v])
        lse[i : i + step] = part
    return o, lse
