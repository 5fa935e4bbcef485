"""Multi-head latent attention with the DSA indexer: the per-token projections of one layer.

Attention itself is not computed here: ``project`` turns hidden states into the absorbed query,
the latent cache row and the indexer's query/key/weights; the caller selects rows and runs
``partial_attention`` (locally, on holders, or both, then merges); ``output`` maps the merged
latent output back to the hidden size. Prefill and decode both go through these three steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from corpusd.model.config import ModelConfig
from corpusd.model.layers import RMSNorm
from corpusd.model.rope import apply_interleaved, rotate_half_layout


@dataclass(frozen=True, slots=True)
class Projections:
    """Everything attention needs from ``n`` new tokens of one layer.

    q: ``[n, h, kv_dim]`` absorbed query ``q_nope·W_UK ‖ rope(q_pe)``.
    cache_row: ``[n, kv_dim]`` latent cache row ``rmsnorm(c_KV) ‖ rope(k_pe)``.
    index_q: ``[n, H_I, D_I]``; index_w: float32 ``[n, H_I]``; index_key: ``[n, D_I]``.
    """

    q: torch.Tensor
    cache_row: torch.Tensor
    index_q: torch.Tensor
    index_w: torch.Tensor
    index_key: torch.Tensor


class Indexer(nn.Module):
    """DSA lightning indexer weights (names as in the checkpoint: ``self_attn.indexer.*``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = (
            cfg.index_n_heads,
            cfg.index_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([rotate_half_layout(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def project(
        self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        q = self._rope(self.wq_b(q_resid).view(n, self.n_heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(h)), cos, sin)
        w = self.weights_proj(h).float() * self.n_heads**-0.5
        return q, w, k


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.num_attention_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        w = self.kv_b_proj.weight.view(
            c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]  # [h, d, kv_lora_rank]

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Projections:
        """``h [n, hidden]`` (after input_layernorm), rope tables for the tokens' positions."""
        c = self.cfg
        n = h.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(h))
        q = self.q_b_proj(q_resid).view(n, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w_uk, _ = self._w_uk_uv()
        q_abs = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        kv = self.kv_a_proj_with_mqa(h)
        c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        row = torch.cat([self.kv_a_layernorm(c_kv), apply_interleaved(k_pe, cos, sin)], dim=-1)
        q_full = torch.cat([q_abs, apply_interleaved(q_pe, cos, sin)], dim=-1)
        iq, iw, ik = self.indexer.project(h, q_resid, cos, sin)
        return Projections(q=q_full, cache_row=row, index_q=iq, index_w=iw, index_key=ik)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Merged latent attention output ``[n, h, kv_lora_rank]`` → ``[n, hidden]``."""
        _, w_uv = self._w_uk_uv()
        o = torch.einsum("nhc,hvc->nhv", o_latent.to(w_uv.dtype), w_uv)
        return self.o_proj(o.reshape(o.shape[0], -1))
