"""DeepSeek-V3.2 in plain torch: the module tree (named as in the HF checkpoint) and its forward.

``forward_tokens`` runs new tokens through every layer against a latent cache that already holds
the earlier positions, appending theirs: a corpus prefill is a sequence of chunks, a decode step
is one token. Attention is sparse exactly as the model defines it: each token attends to the
``index_topk`` positions its indexer ranks highest among those at or before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from corpusd.kernels.reference import partial_attention
from corpusd.model.config import ModelConfig
from corpusd.model.layers import MLP, MoE, RMSNorm
from corpusd.model.mla import MLA, Projections
from corpusd.model.rope import Rotary
from indexer import index_scores, select_topk

if TYPE_CHECKING:
    from corpusd.model.prefill_kernels import Kernels


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = MLA(cfg)
        sparse = cfg.mlp_layer_types[idx] == "sparse"
        self.mlp: nn.Module = (
            MoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Projections:
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def finish(self, x: torch.Tensor, o_latent: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention (given its merged latent output) and the MLP."""
        x = x + self.self_attn.output(o_latent)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV32(nn.Module):
    """The whole model. Parameter names match the HF checkpoint (``model.layers.N…``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    @property
    def layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden ``[n, hidden]`` → float32 logits ``[n, vocab]``."""
        return self.lm_head(self.model.norm(x)).float()


class KVCache:
    """Growable per-layer latent cache ``[T, kv_dim]`` and index keys ``[T, D_I]``."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: str = "cpu"):
        self.cfg = cfg
        self.length = 0
        self.latent = [
            torch.zeros(capacity, cfg.kv_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.index_keys = [
            torch.zeros(capacity, cfg.index_head_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]

    @property
    def capacity(self) -> int:
        return self.latent[0].shape[0]

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for store in (self.latent, self.index_keys):
            for i, t in enumerate(store):
                grown = t.new_zeros(cap, t.shape[1])
                grown[: self.length] = t[: self.length]
                store[i] = grown


def select_rows(
    cfg: ModelConfig,
    proj: Projections,
    index_keys: torch.Tensor,
    positions: torch.Tensor,
    kernels: Kernels | None = None,
) -> torch.Tensor:
    """The model's own DSA selection: top ``index_topk`` positions ``<= position`` by index score.

    ``index_keys [T, D_I]`` holds every position up to ``positions.max()``. Returns int64
    ``[n, min(index_topk, visible)]`` (ascending, ``-1`` padded), ``visible = positions.max() + 1``.
    A row that sees at most ``index_topk`` positions selects all of them without scoring; only
    the other rows are scored (a pin's first chunk: its first ``index_topk`` rows would
    otherwise each take ``select_topk``'s slow path, having fewer than ``k + 1`` keys).
    ``kernels`` picks the scorer (the torch reference without).
    """
    k = cfg.index_topk
    limit = positions + 1
    visible = int(limit.max())
    scored = limit > k
    if visible > k and bool(scored.all()):  # past the first index_topk positions: every row
        return _scored_rows(cfg, proj.index_q, proj.index_w, index_keys[:visible], limit, kernels)
    pos = torch.arange(min(visible, k), device=positions.device)
    every = torch.where(pos[None, :] < limit[:, None], pos[None, :], -1)
    if visible <= k:
        return every
    rows = scored.nonzero().flatten()
    every[rows] = _scored_rows(
        cfg, proj.index_q[rows], proj.index_w[rows], index_keys[:visible], limit[rows], kernels
    )
    return every


def _scored_rows(
    cfg: ModelConfig,
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    limit: torch.Tensor,
    kernels: Kernels | None,
) -> torch.Tensor:
    score = index_scores if kernels is None else kernels.scores
    scores = score(q, w, keys, cfg.index_head_dim**-0.5, cfg.index_arith, limit=limit)
    return select_topk(scores, cfg.index_topk)  # causal keys came back -inf: never selected


@torch.inference_mode()
def forward_tokens(
    model: DeepseekV32,
    tokens: torch.Tensor,
    cache: KVCache,
    want_logits: bool = True,
    kernels: Kernels | None = None,
) -> torch.Tensor | None:
    """Run ``tokens`` (int ``[n]``) at positions ``cache.length …`` through the model.

    Appends their cache rows to ``cache`` (mutates it). Returns float32 logits ``[n, vocab]`` or
    None when ``want_logits`` is False (prefill chunks that only need the cache). ``kernels``
    (``corpusd.model.prefill_kernels.choose``) runs index scores and sparse attention; without
    it, the torch references do.
    """
    cfg = model.cfg
    n = tokens.shape[0]
    start = cache.length
    cache.reserve(n)
    positions = torch.arange(start, start + n, device=tokens.device)
    cos, sin = model.rotary.cos_sin(positions)
    x = model.model.embed_tokens(tokens)
    for li, layer in enumerate(model.layers):
        proj = layer.project(x, cos, sin)
        cache.latent[li][start : start + n] = proj.cache_row
        cache.index_keys[li][start : start + n] = proj.index_key
        sel = select_rows(cfg, proj, cache.index_keys[li][: start + n], positions, kernels)
        attend = partial_attention if kernels is None else kernels.attend
        o, _ = attend(
            proj.q, cache.latent[li][: start + n], sel, cfg.softmax_scale, cfg.kv_lora_rank
        )
        x = layer.finish(x, o)
    cache.length = start + n
    return model.logits(x) if want_logits else None
