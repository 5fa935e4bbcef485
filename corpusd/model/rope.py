"""Rotary position embeddings: YaRN frequencies, MLA's interleaved form, the indexer's half form.

Layout note: DeepSeek checkpoints keep the 64-wide rope band of ``q_pe``/``k_pe`` as interleaved
pairs ``(x0, x1), (x2, x3), …``. Rotating them (``apply_interleaved``) returns the band
*de-interleaved* (``[evens' ‖ odds']``), exactly as transformers' DeepSeek-V3.2 does, so our cache
rows equal its cache. Queries and keys go through the same permutation, so dot products are
unchanged; a later rotation by a position delta (``rotate_half_layout``) acts on that layout.
"""

from __future__ import annotations

import math

import torch

from corpusd.model.config import ModelConfig, RopeConfig, yarn_mscale


def inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies ``[dim // 2]`` float32, with YaRN's ramp between interpolation and
    extrapolation when ``rope.kind == "yarn"``, divided by ``rope.factor`` when "linear"."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.kind == "linear":  # position interpolation: every frequency divided by the factor
        return extrapolation / rope.factor
    if rope.kind != "yarn":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def attention_factor(rope: RopeConfig) -> float:
    """YaRN's magnitude factor applied to cos/sin (1.0 for DeepSeek's mscale == mscale_all_dim)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:  # the config's own, as transformers takes it
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class Rotary:
    """Precomputed frequencies for one model; ``cos_sin`` is cheap enough to call per step."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.dim = cfg.qk_rope_head_dim
        self.inv_freq = inv_freq(cfg.rope, self.dim)
        self.factor = attention_factor(cfg.rope)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int ``[n]`` → (cos, sin), each float32 ``[n, dim // 2]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.factor, freqs.sin() * self.factor

    def shift(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit (cos, sin) ``[n, dim // 2]`` that move an already-rotated band by ``delta [n]``
        more positions (negative: back). Position-independent reuse rotates a query by
        ``-offset`` (route) or a canonical key by ``+offset`` (fetch) with these; RoPE is
        relative, so either gives the same score. No YaRN magnitude factor: it is applied once."""
        freqs = delta.to(torch.float32)[:, None] * self.inv_freq.to(delta.device)[None, :]
        return freqs.cos(), freqs.sin()


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA rope: ``x [n, …, d]`` interleaved pairs, ``cos/sin [n, d/2]`` → rotated, split layout."""
    c = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[1]).to(x.dtype)
    s = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), sin.shape[1]).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rotate_half_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rope: ``x [n, …, d]`` as ``[a ‖ b]``, ``cos/sin [n, d/2]`` →
    ``[a·c − b·s ‖ b·c + a·s]``. This is the indexer's rope, and also rotates an already
    de-interleaved MLA rope band by a further angle."""
    c = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[1]).to(x.dtype)
    s = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), sin.shape[1]).to(x.dtype)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def shift_band(
    x: torch.Tensor, start: int, width: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """A copy of ``x [n, …, d]`` whose band ``[start, start + width)`` (already rotated, split
    layout) is rotated further by ``(cos, sin) [n, width // 2]`` (from :meth:`Rotary.shift`)."""
    out = x.clone()
    out[..., start : start + width] = rotate_half_layout(x[..., start : start + width], cos, sin)
    return out
