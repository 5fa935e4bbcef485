"""The embedded default models: deterministic tiny DeepSeek-V3.2s with random weights.

Two presets, both with the real model's attention geometry where kernels care (64 heads,
kv_lora_rank 512, rope 64 → 576-wide latent rows) and small elsewhere:

- ``cpu`` (the default): a 16,384-id BPE tokenizer trained on source code
  (``tiny_tokenizer.json``, written beside the weights as ``tokenizer.json``) and a 16-head × 64
  indexer. A pin's indexer scores every earlier token, so its cost is ~T²·H_I·D_I: ~5x fewer
  tokens for the same text and an 8x cheaper indexer are what let a 200 KB source tar pin in
  minutes on 2 CPU cores (bench/results/pin-cpu.json).
- ``sglang``: SGLang-shaped for GPU work: byte-level tokens and DeepSeek-V3.2's 64 × 128 indexer
  (SGLang's NSA kernels assume it); FlashMLA needs h ∈ {64, 128}.

Weights are a pure function of (parameter name, seed): the same directory comes out on every
machine.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from corpusd.model.checkpoint import save_checkpoint
from corpusd.model.config import ModelConfig, RopeConfig
from corpusd.model.model import DeepseekV32
from corpusd.tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID

SGLANG = ModelConfig(
    vocab_size=BYTE_VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=64,
    q_lora_rank=128,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    mlp_layer_types=("dense", "sparse"),
    index_n_heads=64,
    index_head_dim=128,
    index_topk=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    rope=RopeConfig(),
)
#: The CPU default's BPE (tools/train_tokenizer.py); ids 0 / 1 are its <bos> / <eos>.
TOKENIZER_JSON = Path(__file__).with_name("tiny_tokenizer.json")
# 16 index heads of 64: a key that every head scores <= 0 scores exactly 0 after the ReLU, and
# with 8 random heads such exact ties reached the top-k cut within a few hundred tokens of text,
# where the transformers oracle breaks them differently from corpusd (lowest position first).
# 16 × 64 costs what 8 × 128 does (the indexer is ~T²·H_I·D_I); index_arith "fp8" needs 128-wide
# keys: use --preset sglang for it.
TINY = replace(
    SGLANG,
    vocab_size=16384,
    index_n_heads=16,
    index_head_dim=64,
    bos_token_id=0,
    eos_token_id=1,
)
PRESETS = {"cpu": TINY, "sglang": SGLANG}


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if name.endswith(("layernorm.weight", "norm.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("k_norm.bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    # Linear-like weights: unit-variance outputs for unit-variance inputs, so attention scores,
    # index scores and logits are spread out enough that selection and argmax are well separated.
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def build_tiny(seed: int = 0, preset: str = "cpu", **overrides: object) -> DeepseekV32:
    """The tiny model in float32 (bf16-rounded weights, as the saved checkpoint holds them)."""
    cfg = replace(preset_config(preset), **overrides)  # type: ignore[arg-type]
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    sd = {
        name: _tensor(name, tuple(p.shape), seed).to(torch.bfloat16).to(p.dtype)
        for name, p in model.state_dict().items()
    }
    model.load_state_dict(sd, assign=True)
    return model.eval()


def preset_config(preset: str) -> ModelConfig:
    """The config of a preset by name; ValueError names the presets."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: one of {', '.join(PRESETS)}")
    return PRESETS[preset]


#: ``fingerprint`` of ``init_tiny(dir, preset=…)`` (seed 0, no overrides): the same bytes on
#: every machine, so a corpus pinned for a random-weight default is recognised without reading
#: a model (tests/unit/test_checkpoint.py holds them to fresh checkpoints). ``sglang``'s is the
#: old default's, unchanged.
TINY_FINGERPRINTS = {
    "cpu": "sha256:79f491a66bcfbbaa74d82836df6a8a11889ac9cb66ce0c612c952278111c8fce",
    "sglang": "sha256:e9b0d264e177ac1837c19d1b61828d4abc665dca3c6c02be694fb4317951102b",
}


def init_tiny(out_dir: str | Path, seed: int = 0, preset: str = "cpu", **overrides: object) -> Path:
    """Write a tiny checkpoint (bf16 safetensors shards + index + config.json, and the
    ``cpu`` preset's tokenizer.json) to ``out_dir``."""
    out = Path(out_dir)
    save_checkpoint(build_tiny(seed, preset, **overrides), out, dtype=torch.bfloat16)
    if preset == "cpu":
        shutil.copyfile(TOKENIZER_JSON, out / "tokenizer.json")
    else:  # a byte-level preset written over a BPE one must not keep its tokenizer
        (out / "tokenizer.json").unlink(missing_ok=True)
    return out
