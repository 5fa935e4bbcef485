"""Which implementation runs the prefill's two heavy ops: index scores and sparse attention.

``forward_tokens`` takes a :class:`Kernels`; without one it runs the torch references
(``indexer.index_scores``, ``partial_attention``), which define the results. On a GPU
``corpusd pin --kernels auto`` (the default) runs the fused Triton index-score kernel
(``indexer/triton_scores.py``) and the attention kernel that ``corpusd.kernels.registry.choose``
picks for the model's rows, the same rule a holder and the SGLang plugin use: on SM90 with a
bf16 model of 576-wide rows, FlashMLA's sparse kernel or Triton per call by its rows and heads;
Triton on another CUDA GPU; the torch reference elsewhere. Each is tested against its reference.
:attr:`Kernels.describe` says which ran and why a faster one did not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corpusd.formats import KERNELS
from corpusd.kernels import registry
from corpusd.kernels.reference import partial_attention
from corpusd.model.config import ModelConfig
from indexer import index_scores


@dataclass(frozen=True)
class Kernels:
    """``scores``: ``index_scores``' contract (with its ``limit``); ``attend``:
    ``partial_attention``'s."""

    scores: Callable[..., torch.Tensor]
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    describe: str

    def warm_up(self, cfg: ModelConfig, device: str, dtype: torch.dtype) -> None:
        """Scorer calls at small shapes, as the prefill calls it (causal limit given): Triton
        compiles its kernel (or loads it from its disk cache) here, not inside the timed
        prefill. Triton specialises the output's row stride (the key count) on divisibility by
        16, so one call of each kind: with only a 1-key call, a 16k-token GPU pin compiled two
        variants inside its timed prefill (tools/profile_prefill.py: 0.39 s wall for 57 ms of
        kernels). Attention needs no call of its own: a one-token forward (``corpusd.corpus.
        pin.warm_up``) attends, and FlashMLA probes its LSE base there, but never scores."""
        h, d_i = cfg.index_n_heads, cfg.index_head_dim
        for t in (32, 33):
            q = torch.zeros(2, h, d_i, dtype=dtype, device=device)
            keys = torch.zeros(t, d_i, dtype=dtype, device=device)
            limit = torch.full((2,), t, dtype=torch.int64, device=device)
            self.scores(q, torch.zeros(2, h, device=device), keys, d_i**-0.5, cfg.index_arith,
                        limit=limit)  # fmt: skip


def choose(cfg: ModelConfig, device: str, dtype: torch.dtype, want: str = "auto") -> Kernels:
    """The fastest kernels that run ``cfg`` in ``dtype`` on ``device`` (``want="auto"``), or the
    torch references (``"torch"``). ValueError for another ``want``."""
    if want not in KERNELS:
        raise ValueError(f"unknown prefill kernels {want!r}: one of {', '.join(KERNELS)}")
    scores: Callable[..., torch.Tensor] = index_scores
    s_name = "torch index scores"
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] = partial_attention
    a_name = "torch sparse attention"
    if want == "auto" and device.startswith("cuda"):
        from indexer import triton_scores  # imports Triton: only where it may run

        if triton_scores.usable(torch.device(device)):
            scores, s_name = triton_scores.triton_index_scores, "Triton index scores"
        else:
            s_name += " (no CUDA GPU)" if triton_scores.importable() else " (no Triton)"
        pool = (dtype, cfg.kv_dim, cfg.kv_lora_rank)
        kernel = registry.choose("auto", device, *pool)
        why_not = registry.passed_over(kernel, device, *pool)
        registry.report(kernel, device, "prefill", why_not=why_not)
        if kernel.name != "torch":
            attend = kernel.fn
        a_name = registry.describe(kernel, why_not, "sparse attention")
    return Kernels(scores, attend, f"{s_name}, {a_name}")
