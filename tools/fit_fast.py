"""The fit's fast training forward: a batch of sequences at once, attention through
``scaled_dot_product_attention`` (a fused kernel on a GPU), the indexer's KL on sampled rows.

``tools/fit_tiny.py``'s reference forward (``train_forward``) runs one sequence at a time in the
absorbed form (``q·W_UK`` against 576-wide latent rows) and materialises every layer's float32
attention weights ``[n, heads, n]``: 1 GiB a layer at 2,048 tokens × 64 heads, read and written
several times a step. On an H200 it fitted 3.4 steps of 2 × 2,048 tokens a second at 64 heads ×
2 layers (``bench/results/span-fit-g64x2-h200.json``), too few for copying to form in minutes.

Here attention runs in MLA's other, mathematically equal form (DeepSeek-V2's training form):
per head ``k = [W_UK·c ‖ rope(k_pe)]`` (192 wide) and ``v = W_UV·c`` (128 wide) from the latent
``c``, so ``q·k`` equals the absorbed ``q_abs·row`` and ``softmax·v`` equals ``W_UV·(softmax·c)``
(the test holds the two forwards to the same logits). With keys and values that narrow, SDPA
picks a fused kernel (flash or memory-efficient) on a GPU in bf16 and never forms the weights.

The indexer's warm-up KL needs the attention's weights (summed over heads), so it is computed on
``index_rows`` query rows of each sequence drawn at random: the KL's mean over all rows,
estimated without bias from a sample, at a small fraction of the cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corpusd.model import DeepseekV32
from corpusd.model.mla import MLA
from corpusd.model.rope import apply_interleaved


def _heads(attn: MLA, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:  # fmt: skip
    """``h [B, n, hidden]`` (normed) → per head q, k ``[B, H, n, nope + rope]``, v ``[B, H, n,
    v_dim]``, and the query LoRA residual ``[B, n, q_lora]`` (the indexer's input)."""
    c = attn.cfg
    b, n, _ = h.shape
    rows = h.reshape(b * n, -1)
    cos_r, sin_r = cos.repeat(b, 1), sin.repeat(b, 1)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(rows))
    q = attn.q_b_proj(q_resid).view(b * n, c.num_attention_heads, c.qk_head_dim)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    kv = attn.kv_a_proj_with_mqa(rows)
    c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm(c_kv)
    w_uk, w_uv = attn._w_uk_uv()
    k_nope = torch.einsum("nc,hdc->nhd", latent, w_uk)
    v = torch.einsum("nc,hvc->nhv", latent, w_uv)
    k_rope = apply_interleaved(k_pe, cos_r, sin_r)[:, None, :].expand(-1, c.num_attention_heads, -1)
    qh = torch.cat([q_nope, apply_interleaved(q_pe, cos_r, sin_r)], dim=-1)
    kh = torch.cat([k_nope, k_rope], dim=-1)

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, n, c.num_attention_heads, -1).transpose(1, 2)

    return split(qh), split(kh), split(v), q_resid.view(b, n, -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention, ``[B, H, n, d]`` → ``[B, H, n, d_v]``; bf16 on a GPU (a fused kernel),
    as given elsewhere. v is padded to the key width where a fused kernel needs equal widths."""
    dtype = q.dtype
    if q.is_cuda:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    dv = v.shape[-1]
    if q.is_cuda and dv != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o[..., :dv].to(dtype)


def _index_kl(
    attn: MLA, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The indexer's warm-up KL (``fit_tiny.index_kl``), mean over the query ``rows`` (int64
    ``[r]``, the same in every sequence) of each of the ``B`` sequences. Only the indexer's own
    weights get a gradient: its inputs and the attention target are detached."""
    b, n, _ = h.shape
    ix = attn.indexer
    iq, iw, ik = ix.project(h.detach().reshape(b * n, -1), q_resid.detach().reshape(b * n, -1),
                            cos.repeat(b, 1), sin.repeat(b, 1))  # fmt: skip
    iq = iq.view(b, n, ix.n_heads, -1)[:, rows]  # [B, r, H_I, D_I]
    iw = iw.view(b, n, ix.n_heads)[:, rows]
    ik = ik.view(b, n, -1)
    future = torch.arange(n, device=h.device)[None, :] > rows[:, None]  # [r, n]
    with torch.no_grad():
        s = torch.einsum("bhrd,bhkd->bhrk", q[:, :, rows].float(), k.float()) * scale
        p = s.masked_fill(future[None, None], float("-inf")).softmax(dim=-1).sum(dim=1)
        target = p / p.sum(dim=-1, keepdim=True)  # [B, r, n]
    si = torch.einsum("brhd,bkd->brhk", iq.float() * ix.scale, ik.float()).relu()
    si = (iw.float()[..., None] * si).sum(dim=2)
    logq = si.masked_fill(future[None], float("-inf")).log_softmax(dim=-1)
    return attention_kl(target, logq, future[None])


def attention_kl(target: torch.Tensor, logq: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """Mean over query rows of KL(``target`` ‖ exp ``logq``), each row a distribution over keys
    (``[..., rows, keys]``), ``future`` (broadcast to them) masking the keys a row cannot see,
    where ``logq`` is ``-inf`` and ``target`` 0."""
    kl = torch.special.xlogy(target, target) - target * logq.masked_fill(future, 0.0)
    return kl.sum(dim=-1).mean()


def train_forward_batch(
    model: DeepseekV32, tokens: torch.Tensor, index_rows: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Differentiable forward of ``B`` sequences from position 0 (padding at their ends does not
    reach earlier positions: attention is causal): int ``[B, n]`` → float32 ``[B, n, vocab]``
    logits, and with ``index_rows`` > 0 the indexers' KL on that many sampled query rows, summed
    over layers. Needs ``n <= index_topk`` (dense selection), as ``fit_tiny.train_forward``."""
    cfg = model.cfg
    b, n = tokens.shape
    assert n <= cfg.index_topk, f"{n=} > {cfg.index_topk=}: the indexer would select"
    cos, sin = model.rotary.cos_sin(torch.arange(n, device=tokens.device))
    x = model.model.embed_tokens(tokens)
    rows = None
    if index_rows > 0:
        pick = torch.randperm(n, generator=generator)[: min(index_rows, n)]
        rows = pick.sort().values.to(tokens.device)
    kl = None
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v, q_resid = _heads(attn, h, cos, sin)
        if rows is not None:
            one = _index_kl(attn, h, q_resid, cos, sin, q, k, cfg.softmax_scale, rows)
            kl = one if kl is None else kl + one
        o = _attend(q, k, v, cfg.softmax_scale)  # [B, H, n, v_dim]
        o = o.transpose(1, 2).reshape(b * n, -1)
        x = x + attn.o_proj(o).view(b, n, -1)
        x = x + layer.mlp(layer.post_attention_layernorm(x).view(b * n, -1)).view(b, n, -1)
    return model.logits(x.view(b * n, -1)).view(b, n, -1), kl
