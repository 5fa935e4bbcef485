"""HF-format checkpoint directories: load (sharded, fp8 block-scaled or not) and save.

Parameter names are the real DeepSeek-V3.2 checkpoint's. Routed experts may be stored one by one
(``mlp.experts.E.{gate,up,down}_proj.weight``, as DeepSeek and transformers' ``save_pretrained``
write them) or fused (``mlp.experts.gate_up_proj`` / ``down_proj``); in memory they are fused.
Layers past ``num_hidden_layers`` (DeepSeek's multi-token-prediction layer) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from corpusd.model.config import ModelConfig, ModelConfigError
from corpusd.model.model import DeepseekV32

_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP32_KEEP = ("e_score_correction_bias",)
DEFAULT_QUANT_BLOCK = (128, 128)


class CheckpointError(ValueError):
    """A checkpoint directory corpusd cannot load; the message names the file or tensor."""


def weight_files(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint: from the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shard index names missing files: {missing[:3]}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def dequantize_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Block-scaled fp8 → float32: ``w[i, j] · scale_inv[i // b0, j // b1]``."""
    out_f, in_f = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)
    return w.float() * s[:, :in_f]


def read_state_dict(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Read a checkpoint into our in-memory names (fused experts), dequantised, as ``dtype``."""
    model_dir = Path(model_dir)
    raw: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    m = _LAYER.match(name)
                    if m and int(m.group(1)) >= cfg.num_hidden_layers:
                        continue  # MTP layer(s)
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raw[name] = st.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {f}: {e}") from None

    block = cfg.quant_block or DEFAULT_QUANT_BLOCK
    for name in [n for n in raw if n.endswith(".weight_scale_inv")]:
        base = name[: -len("_scale_inv")]
        if base not in raw:
            raise CheckpointError(f"{name} has no weight {base}")
        raw[base] = dequantize_fp8(raw[base], raw.pop(name), block)

    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    sd: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"{name} is {t.dtype} but has no weight_scale_inv")
        m = _EXPERT.match(name)
        if m:
            experts[m.group(1)][int(m.group(2))][m.group(3)] = t
            continue
        keep32 = name.endswith(_FP32_KEEP)
        sd[name] = t.to(torch.float32 if keep32 else dtype)
    for prefix, per in experts.items():
        ids = sorted(per)
        if ids != list(range(cfg.n_routed_experts)):
            raise CheckpointError(f"{prefix}: expected experts 0..{cfg.n_routed_experts - 1}")
        try:
            sd[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in ids]
            ).to(dtype)
            sd[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in ids]).to(dtype)
        except KeyError as e:
            raise CheckpointError(f"{prefix}: an expert lacks {e.args[0]}") from None
    return sd


EMBED = "model.embed_tokens.weight"


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DeepseekV32:
    """Load a DeepSeek-V3.2 checkpoint directory. Raises ModelConfigError / CheckpointError."""
    cfg = ModelConfig.from_dir(model_dir)
    sd = read_state_dict(model_dir, cfg, dtype)
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings and "lm_head.weight" not in sd and EMBED in sd:
        sd["lm_head.weight"] = sd[EMBED]  # tied: the checkpoint stores it once
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match the config: missing {missing[:4]}"
            f"{'…' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
            f"{'…' if len(unexpected) > 4 else ''}"
        )
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{name}: shape {tuple(t.shape)} in the checkpoint, {tuple(expected[name].shape)} "
                "by the config"
            )
    model.load_state_dict(sd, assign=True)
    return model.to(device).eval()


def checkpoint_tensors(model: DeepseekV32) -> dict[str, torch.Tensor]:
    """Our state dict under the checkpoint's names: fused experts split one by one."""
    out: dict[str, torch.Tensor] = {}
    inter = model.cfg.moe_intermediate_size
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def save_checkpoint(
    model: DeepseekV32,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 16 << 20,
) -> None:
    """Write ``config.json`` + sharded ``model-0000i-of-0000n.safetensors`` + the shard index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(torch.float32 if k.endswith(_FP32_KEEP) else dtype).contiguous()
        for k, v in checkpoint_tensors(model).items()
    }
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))


def fingerprint(model_dir: str | Path) -> str:
    """A content fingerprint of a checkpoint: ``sha256:<hex>`` over the canonical config, every
    weight file's name, size, safetensors header and 16 sampled 64 KiB windows, and the whole
    ``tokenizer.json`` when there is one (it gives token ids their meaning).

    Sampling keeps this O(1) in checkpoint size (a real V3.2 checkpoint is ~700 GB); any two
    checkpoints that differ in config, tensor layout or in weights at the sampled windows differ
    here. Raises ModelConfigError/CheckpointError like ``load_model``.
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    h = hashlib.sha256(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    for f in weight_files(model_dir):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            head_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(head_len, 1 << 24)))
            for i in range(16):
                fh.seek(size * i // 16)
                h.update(fh.read(1 << 16))
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.is_file():  # absent: the byte-level tokenizer, as before (same fingerprints)
        h.update(b"tokenizer.json:" + hashlib.sha256(tokenizer.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


__all__ = [
    "CheckpointError",
    "ModelConfigError",
    "dequantize_fp8",
    "fingerprint",
    "load_model",
    "read_state_dict",
    "save_checkpoint",
]
