"""Checkpoints written by transformers itself (``save_pretrained``), not by ``corpusd model init``:
a DeepSeek-V3.2 config with other widths and counts than the tiny default."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from corpusd.tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID

#: What every such config shares: byte tokens, small everywhere the overrides do not reach.
BASE: dict[str, Any] = dict(
    vocab_size=BYTE_VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    q_lora_rank=64,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def _init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """corpusd.model.tiny's scheme: unit-variance activations, so attention scores, index scores
    and logits are spread well apart (transformers' 0.02-std init leaves near-ties)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5  # [.., out, in]: fan-in last


def write_hf_checkpoint(out: Path, seed: int = 0, **config: Any) -> Path:
    """``DeepseekV32ForCausalLM(DeepseekV32Config(**BASE | config)).save_pretrained(out)`` in
    bf16, with deterministic weights (a function of parameter name and ``seed``)."""
    import transformers

    cfg = transformers.DeepseekV32Config(**(BASE | config))
    model = transformers.DeepseekV32ForCausalLM(cfg)
    sd = {
        name: _init(name, tuple(p.shape), seed).to(torch.bfloat16).to(p.dtype)
        for name, p in model.state_dict().items()
    }
    model.load_state_dict(sd)
    model.to(torch.bfloat16).save_pretrained(out)
    return out
