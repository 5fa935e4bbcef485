"""Checkpoints written by transformers itself (``save_pretrained``), not by ``corpusd model init``:
a DeepSeek-V3.2 config with other widths and counts than the tiny default."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
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


def write_hf_checkpoint(out: Path, seed: int = 0, minimal: bool = False, **config: Any) -> Path:
    """``DeepseekV32ForCausalLM(DeepseekV32Config(**BASE | config)).save_pretrained(out)`` in
    bf16, with deterministic weights (a function of parameter name and ``seed``). ``minimal``:
    the config.json keeps only the keys whose values differ from transformers' defaults, as a
    hand-written one may (:func:`minimal_config`)."""
    import transformers

    cfg = transformers.DeepseekV32Config(**(BASE | config))
    model = transformers.DeepseekV32ForCausalLM(cfg)
    sd = {
        name: _init(name, tuple(p.shape), seed).to(torch.bfloat16).to(p.dtype)
        for name, p in model.state_dict().items()
    }
    model.load_state_dict(sd)
    for p in model.parameters():  # bf16 in place (transformers' typed ``to`` confuses mypy)
        p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(out)
    if minimal:
        minimal_config(out / "config.json")
    return out


def minimal_config(path: Path) -> None:
    """Rewrite the config.json at ``path`` without the keys transformers would fill in with the
    same value (its ``DeepseekV32Config()`` defaults), model_type kept."""
    import transformers

    defaults = transformers.DeepseekV32Config().to_dict()
    d = json.loads(path.read_text())
    keep = {k: v for k, v in d.items() if k == "model_type" or defaults.get(k, ...) != v}
    path.write_text(json.dumps(keep, indent=2))


@dataclass(frozen=True)
class Drawn:
    """A drawn config: ``overrides`` for :func:`write_hf_checkpoint` (``BASE | overrides`` is what
    transformers gets) and, for one corpusd must refuse, the field its one-line refusal names."""

    seed: int
    overrides: dict[str, Any]
    refused_field: str | None = None
    minimal: bool = False  # the config.json without the keys at transformers' defaults


#: Head counts: powers of two, others, V3.2's 128 and 160 (past FlashMLA's 128 a call: the
#: holder runs it per group of 128). 160 took 48's place, so every other seed draws what it drew.
HEADS = (1, 2, 3, 5, 8, 12, 16, 20, 24, 160, 128)
#: Values corpusd refuses, one field each: (field, overrides that break it).
UNSERVABLE: tuple[tuple[str, dict[str, Any]], ...] = (
    ("num_attention_heads", dict(num_attention_heads=1040, num_key_value_heads=1040)),
    ("index_head_dim", dict(index_head_dim=8, qk_rope_head_dim=16)),
    ("kv_lora_rank", dict(kv_lora_rank=0)),
    ("qk_rope_head_dim", dict(qk_rope_head_dim=9, index_head_dim=32)),
)


def draw_config(seed: int, corpus_tokens: int = 256, refuse_p: float = 0.1) -> Drawn:
    """A valid DeepSeek-V3.2 config drawn from ``seed`` (the same seed, the same config), small
    enough to pin and decode in seconds on a CPU; with probability ``refuse_p`` one field is then
    broken (:data:`UNSERVABLE`) and ``refused_field`` names it.

    ``index_topk`` is below ``corpus_tokens`` about two times in three (the sparse path) and above
    it otherwise. ``index_n_heads`` is 8, 16, 24 or 64 (8 took 32's place, so every other seed
    draws what it drew): with 8, a key every head scores ≤ 0 scores exactly 0 after the ReLU,
    and random weights put such exact ties at the top-k cut; the oracle breaks them as corpusd
    does (lowest position first, :func:`corpusd.testing.oracle.lowest_position_ties`). Routed
    groups hold ≥ 2 experts (transformers sums each group's top 2) and ``num_experts_per_tok``
    fits in the ``topk_group`` groups kept (else transformers picks among zeroed scores)."""
    rng = random.Random(seed)
    layers = rng.randint(1, 3)
    rope = rng.choice((8, 16, 32, 64))
    heads = rng.choice(HEADS)
    n_group = rng.randint(1, 3)
    per_group = rng.randint(2, 4)
    topk_group = rng.randint(1, n_group)
    c: dict[str, Any] = dict(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=rng.choice((16, 32, 64, 96)),
        kv_lora_rank=rng.choice((16, 48, 64, 128, 192)),
        qk_nope_head_dim=rng.choice((8, 16, 32, 48)),
        qk_rope_head_dim=rope,
        v_head_dim=rng.choice((8, 16, 24, 40, 64)),
        index_n_heads=rng.choice((16, 24, 8, 64)),
        index_head_dim=rng.choice(tuple(d for d in (16, 32, 48, 64, 128) if d >= rope)),
        index_topk=rng.choice(
            (corpus_tokens // 8, corpus_tokens // 4, corpus_tokens // 2, 2 * corpus_tokens)
        ),
        n_routed_experts=n_group * per_group,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=rng.randint(1, topk_group * per_group),
        n_shared_experts=rng.randint(1, 2),
        moe_intermediate_size=rng.choice((16, 32, 64)),
    )
    if rng.random() < 0.5:
        c["mlp_layer_types"] = [rng.choice(("dense", "sparse")) for _ in range(layers)]
    else:  # transformers derives the layout; so does corpusd's loader
        c["first_k_dense_replace"] = rng.randint(0, layers)
    if rng.random() < 0.35:
        factor, original = rng.choice((2.0, 4.0, 40.0)), rng.choice((256, 512))
        mscale = rng.choice((0.707, 1.0))
        c["max_position_embeddings"] = int(factor * original)
        c["rope_parameters"] = dict(
            rope_type="yarn",
            rope_theta=rng.choice((10000.0, 50000.0)),
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=mscale,
            mscale_all_dim=mscale,
        )
    if rng.random() < refuse_p:
        field, broken = rng.choice(UNSERVABLE)
        return Drawn(seed, c | broken, field)
    return Drawn(seed, c)


def write_hf_config(out: Path, **config: Any) -> Path:
    """Only a ``config.json`` (no weights): transformers' for ``BASE | config`` where it accepts
    that, else (e.g. an odd rope width, which transformers itself refuses) its config for
    ``BASE`` with ``config``'s keys written over, as a hand-edited file would be."""
    import transformers

    try:
        transformers.DeepseekV32Config(**(BASE | config)).save_pretrained(out)
    except Exception:  # huggingface_hub's validation error is no ValueError
        transformers.DeepseekV32Config(**BASE).save_pretrained(out)
        path = out / "config.json"
        d = json.loads(path.read_text())
        d.pop("mlp_layer_types")  # BASE's, for its own layer count; config's own if it has one
        path.write_text(json.dumps(d | config, indent=2))
    return out
