"""Checkpoint round trips with transformers, fp8 block dequantisation, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from corpusd.model import CheckpointError, KVCache, ModelConfigError, forward_tokens, load_model
from corpusd.model.checkpoint import checkpoint_tensors, dequantize_fp8, fingerprint
from corpusd.testing.numeric import rel


def _logits(model, toks: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = forward_tokens(model, toks, KVCache(model.cfg, len(toks), torch.float32))
    assert out is not None
    return out


def test_tiny_checkpoint_is_sharded_and_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    from corpusd.model.tiny import TINY_FINGERPRINTS, init_tiny

    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "tiny checkpoint should exercise sharding"
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in index["weight_map"]
    again = init_tiny(tmp_path / "again")
    assert fingerprint(again) == fingerprint(tiny_dir) == TINY_FINGERPRINTS["cpu"]
    sglang = init_tiny(tmp_path / "sglang", preset="sglang")
    assert fingerprint(sglang) == TINY_FINGERPRINTS["sglang"]
    other = init_tiny(tmp_path / "other", seed=1)
    assert fingerprint(other) != fingerprint(tiny_dir)
    # The tokenizer gives ids their meaning: another tokenizer.json, another fingerprint.
    (again / "tokenizer.json").write_text("{}")
    assert fingerprint(again) != TINY_FINGERPRINTS["cpu"]
    # A byte-level preset written over the BPE one leaves no tokenizer.json behind.
    assert not (init_tiny(again, preset="sglang") / "tokenizer.json").exists()


def test_we_read_what_transformers_saves(hf_model, tiny_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="5MB")
    ours = load_model(tmp_path / "hf")
    for name, t in tiny_model.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t), name
    toks = torch.arange(40) % 256
    with torch.no_grad():
        ref = hf_model(toks[None]).logits[0]
    assert rel(_logits(ours, toks), ref) <= 1e-4


def test_we_read_fused_experts(tiny_model, tiny_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text((tiny_dir / "config.json").read_text())
    save_file(
        {k: v.contiguous() for k, v in tiny_model.state_dict().items()}, str(d / "m.safetensors")
    )
    ours = load_model(d)
    toks = torch.arange(30) % 256
    assert torch.equal(_logits(ours, toks), _logits(tiny_model, toks))


def test_fp8_block_scaled_weights_are_dequantised(
    tiny_model, tiny_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    tensors = checkpoint_tensors(tiny_model)
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [16384, 512]: 128 × 4 blocks
    w = tensors[name].float()
    blocks = w.view(w.shape[0] // 128, 128, w.shape[1] // 128, 128).abs().amax(dim=(1, 3))
    scale_inv = blocks / 448.0
    expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q = (w / expanded).to(torch.float8_e4m3fn)
    d = tmp_path / "fp8"
    d.mkdir()
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    tensors[name] = q
    tensors[name + "_scale_inv"] = scale_inv
    save_file(tensors, str(d / "model.safetensors"))
    loaded = load_model(d).state_dict()["model.layers.0.self_attn.kv_b_proj.weight"]
    assert torch.equal(loaded, dequantize_fp8(q, scale_inv, (128, 128)))
    assert torch.equal(loaded, q.float() * expanded)
    assert rel(loaded, w) < 0.05  # fp8 e4m3 keeps ~3 mantissa bits


def test_other_model_types_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="model_type 'llama' is not supported"):
        load_model(tmp_path)


def test_missing_and_mismatched_weights_are_named(
    tiny_model, tiny_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = {k: v.contiguous() for k, v in checkpoint_tensors(tiny_model).items()}
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\]"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        (tmp_path / "model.safetensors").unlink()
        load_model(tmp_path)
    with pytest.raises(ModelConfigError, match=r"config\.json not found"):
        load_model(tmp_path / "nowhere")
