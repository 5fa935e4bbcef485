"""Feed-forward parts of a DeepSeek-V3.2 layer: RMSNorm, the dense gated MLP, the routed MoE."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from corpusd.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


#: The gate activation by transformers' ACT2FN name (``config.ACTS``). gelu_new and gelu_fast
#: are the tanh approximation written out; PyTorch's tanh GELU is the same function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh, "gelu_fast": _gelu_tanh, "quick_gelu": _quick_gelu,
    "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
}  # fmt: skip


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, act = silu for DeepSeek-V3.2 (SwiGLU)."""

    def __init__(self, hidden: int, inner: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid router with group-limited top-k and a score-correction bias (DeepSeek-V3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [n, H]`` → (expert ids int64 ``[n, top_k]``, weights float32 ``[n, top_k]``)."""
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = c.n_routed_experts // c.n_group
        group_scores = choice.view(-1, c.n_group, per_group).topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(c.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        expert_mask = group_mask.repeat_interleave(per_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor


#: Run every expert on every row when there are at most this many experts per routed one.
DENSE_MAX_RATIO = 4


class Experts(nn.Module):
    """Routed experts stored stacked: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [n, H]``, the router's ``ids``/``w [n, top_k]`` → ``Σ_j w[:, j] · expert_ids[j](x)``.

        With few experts per routed one (``E <= DENSE_MAX_RATIO · top_k``, as in the tiny
        models) every expert runs on every row in three batched matmuls and the unrouted ones
        get weight 0: at most that many times the FLOPs, but ~8 ops instead of ~11 per expert,
        and on a busy 2-core CPU each op's thread barrier costs more than the FLOPs. Real
        V3.2 (256 experts, 8 routed) takes the per-expert loop. Both compute each routed
        expert's rows identically; only the order of the final weighted sum differs.
        """
        e = self.gate_up_proj.shape[0]
        if x.shape[0] > 1 and e <= DENSE_MAX_RATIO * ids.shape[1]:
            return self._dense(x, ids, w)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * w[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out

    def _dense(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E,n,I]
        y = torch.matmul(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, n, H]
        dense_w = torch.zeros(x.shape[0], y.shape[0], dtype=x.dtype, device=x.device)
        dense_w.scatter_(1, ids, w.to(x.dtype))  # [n, E]: 0 for experts not routed to
        return torch.einsum("ne,enh->nh", dense_w, y)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x)
        return self.experts(x, ids, w) + self.shared_experts(x)
