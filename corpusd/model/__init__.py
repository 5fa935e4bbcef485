"""DeepSeek-V3.2 (MLA + DSA indexer) in plain torch, its checkpoints and the tiny default."""

from corpusd.model.checkpoint import CheckpointError, fingerprint, load_model, save_checkpoint
from corpusd.model.config import ModelConfig, ModelConfigError
from corpusd.model.model import DeepseekV32, KVCache, forward_tokens, select_rows

__all__ = [
    "CheckpointError",
    "DeepseekV32",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "fingerprint",
    "forward_tokens",
    "load_model",
    "save_checkpoint",
    "select_rows",
]
