"""The model's hyper-parameters, read from (and written as) a HuggingFace ``config.json``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from indexer import ARITHS

SUPPORTED_MODEL_TYPE = "deepseek_v32"
#: The most attention heads a holder's Attend takes: a bound on one request's reply (rows ×
#: heads × d_v floats), not on a kernel. V3.2 has 128; FlashMLA's kernels take at most 128 a
#: call, so past that the holder runs them per group of 128 heads (``kernels.flashmla``), and
#: the NVSHMEM ring fits fewer rows a slot (the requester splits by rows).
MAX_HEADS = 1024
#: Widths and counts that must be positive whatever the MLP layout.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
)


class ModelConfigError(ValueError):
    """A checkpoint's config.json that corpusd cannot serve; the message says why."""


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude ``0.1 · m · ln(factor) + 1`` (1 for a factor ≤ 1), as transformers and
    DeepSeek's code compute it."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE parameters (DeepSeek's ``rope_scaling``): ``kind`` "yarn" (DeepSeek-V3.2's),
    "linear" (positions divided by ``factor``; ``mscale_all_dim`` scales the softmax as
    transformers does for any scaled rope) or "default" (plain)."""

    theta: float = 10000.0
    kind: str = "yarn"
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True
    # yarn: the cos/sin factor when the config gives one (transformers' ``attention_factor``);
    # None derives it from factor, mscale and mscale_all_dim
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("yarn", "linear", "default"):
            raise ModelConfigError(
                f"rope type {self.kind!r} is not supported (yarn, linear or default)"
            )
        if self.kind != "default" and self.factor <= 0:
            raise ModelConfigError(f"{self.kind} rope factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """DeepSeek-V3.2 architecture hyper-parameters (names follow the HF config where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    rope: RopeConfig = field(default_factory=RopeConfig)
    quant_block: tuple[int, int] | None = None
    # The indexer's arithmetic: "exact" (float32, transformers) or "fp8" (Hadamard-rotated,
    # ue8m0-scaled float8, as DeepSeek's inference code and SGLang; indexer/fp8.py). corpusd's
    # own key, written to config.json only when not "exact".
    index_arith: str = "exact"
    # lm_head shares the embedding's weights (transformers' tie_word_embeddings; DeepSeek-V3.2's
    # own checkpoints do not)
    tie_word_embeddings: bool = False
    # transformers' attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj (V3.2: none)
    attention_bias: bool = False
    # the MLPs' and experts' gate activation, by transformers' ACT2FN name (V3.2: silu)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        bad = [f"{k} {getattr(self, k)}" for k in _SIZES if getattr(self, k) <= 0]
        if bad:
            raise ModelConfigError(f"widths and counts must be > 0: {', '.join(bad)}")
        if self.num_attention_heads > MAX_HEADS:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} > {MAX_HEADS}: a holder's "
                f"Attend takes at most {MAX_HEADS} heads a request"
            )
        if self.index_arith not in ARITHS:
            raise ModelConfigError(
                f"index_arith must be 'exact' or 'fp8', got {self.index_arith!r}"
            )
        if self.index_arith == "fp8" and self.index_head_dim % 128:
            raise ModelConfigError(
                "index_arith 'fp8' quantises 128-wide blocks; "
                f"index_head_dim is {self.index_head_dim}"
            )
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(
                f"index_head_dim {self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim}: "
                "the indexer rotates its first qk_rope_head_dim dims"
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        bad = sorted(set(self.mlp_layer_types) - {"dense", "sparse"})
        if bad:
            raise ModelConfigError(f"mlp_layer_types may hold 'dense' or 'sparse', got {bad}")
        if "sparse" in self.mlp_layer_types:
            if min(self.n_group, self.n_routed_experts, self.moe_intermediate_size) <= 0:
                raise ModelConfigError(
                    "MoE layers need n_group, n_routed_experts and moe_intermediate_size > 0"
                )
            if self.n_routed_experts % self.n_group:
                raise ModelConfigError(
                    f"n_routed_experts {self.n_routed_experts} is not a multiple of "
                    f"n_group {self.n_group}"
                )
            if not 0 < self.topk_group <= self.n_group:
                raise ModelConfigError(f"topk_group must be in 1..{self.n_group}")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ModelConfigError("num_experts_per_tok must be in 1..n_routed_experts")
        if self.index_topk <= 0:
            raise ModelConfigError(f"index_topk must be > 0, got {self.index_topk}")

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one latent cache row: ``c_KV`` (kv_lora_rank) then ``k_pe`` (rope dims)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: ``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor)**2``."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.kind != "default" and r.mscale_all_dim:  # transformers' rule
            scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
        return scale

    # -- HF config.json ----------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``.

        Accepts both the legacy DeepSeek keys (``rope_scaling`` + ``rope_theta``) and
        transformers 5's ``rope_parameters``. A key left out takes transformers' default
        (:data:`HF_DEFAULTS`). Raises ModelConfigError for another model type, a value corpusd
        does not compute, or a malformed one.
        """
        mt = d.get("model_type")
        if mt != SUPPORTED_MODEL_TYPE:
            raise ModelConfigError(
                f"model_type {mt!r} is not supported: corpusd serves {SUPPORTED_MODEL_TYPE!r} "
                "(DeepSeek-V3.2: MLA + DSA indexer) checkpoints"
            )
        _refuse_unserved(d)
        try:
            n_layers = int(_hf(d, "num_hidden_layers"))
            first_dense = int(_hf(d, "first_k_dense_replace"))
            mlp_types = d.get("mlp_layer_types") or (
                ["dense"] * min(first_dense, n_layers) + ["sparse"] * max(0, n_layers - first_dense)
            )
            rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
            theta = float(rp.get("rope_theta", _hf(d, "rope_theta")))
            kind = rp.get("rope_type", rp.get("type", "default"))
            if kind == "yarn":
                rope = RopeConfig(
                    theta=theta,
                    kind="yarn",
                    factor=float(rp["factor"]),
                    original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
                    beta_fast=float(rp.get("beta_fast") or 32),
                    beta_slow=float(rp.get("beta_slow") or 1),
                    mscale=float(rp.get("mscale") or 0),
                    mscale_all_dim=float(rp.get("mscale_all_dim") or 0),
                    truncate=bool(rp.get("truncate", True)),
                    attention_factor=(
                        None
                        if rp.get("attention_factor") is None
                        else float(rp["attention_factor"])
                    ),
                )
            elif kind == "linear":
                rope = RopeConfig(
                    theta=theta,
                    kind="linear",
                    factor=float(rp["factor"]),
                    mscale_all_dim=float(rp.get("mscale_all_dim") or 0),
                )
            else:
                rope = RopeConfig(theta=theta, kind=str(kind))
            q = d.get("quantization_config") or {}
            block = q.get("weight_block_size")
            eos = _hf(d, "eos_token_id")
            plain = {key: kind(_hf(d, key)) for key, kind in _PLAIN.items()}
            return cls(
                **plain,
                num_hidden_layers=n_layers,
                n_routed_experts=int(_routed_experts(d)),
                first_k_dense_replace=first_dense,
                mlp_layer_types=tuple(mlp_types),
                bos_token_id=_hf(d, "bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
                rope=rope,
                quant_block=(int(block[0]), int(block[1])) if block else None,
                index_arith=str(d.get("index_arith", "exact")),
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json has a malformed value: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} not found: a model directory needs a config.json")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` content (readable by transformers' ``DeepseekV32Config``)."""
        r = self.rope
        rope_params: dict[str, Any] = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "linear":
            rope_params["factor"] = r.factor
            if r.mscale_all_dim:
                rope_params["mscale_all_dim"] = r.mscale_all_dim
        if r.kind == "yarn":
            rope_params.update(
                factor=r.factor,
                original_max_position_embeddings=r.original_max_position_embeddings,
                beta_fast=r.beta_fast,
                beta_slow=r.beta_slow,
                mscale=r.mscale,
                mscale_all_dim=r.mscale_all_dim,
            )
            if r.attention_factor is not None:
                rope_params["attention_factor"] = r.attention_factor
        d = asdict(self)
        for k in ("rope", "quant_block"):
            d.pop(k)
        if self.index_arith == "exact":
            d.pop("index_arith")  # transformers' config, unchanged
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d.update(
            model_type=SUPPORTED_MODEL_TYPE,
            architectures=["DeepseekV32ForCausalLM"],
            num_key_value_heads=self.num_attention_heads,
            rope_parameters=rope_params,
            torch_dtype="bfloat16",
            # Read by SGLang's DeepSeek-V3 family loader, which has no defaults for them; they
            # restate what this config already means (sigmoid-scored, bias-corrected routing;
            # no MTP layer).
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            num_nextn_predict_layers=0,
        )
        n_dense = self.first_k_dense_replace
        sparse_after = ("dense",) * n_dense + ("sparse",) * (self.num_hidden_layers - n_dense)
        if self.mlp_layer_types == sparse_after:
            d["moe_layer_freq"] = 1  # SGLang's way of saying "every layer from k on is sparse"
        return d


#: transformers' ``DeepseekV32Config`` defaults (its class attributes, and its rope theta): a key
#: a config.json leaves out means this value to transformers, so it means it here too
#: (``tests/unit/test_model_limits.py`` holds the two equal where transformers is installed).
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "attention_bias": False, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "first_k_dense_replace": 3, "rope_theta": 10000.0,
}  # fmt: skip


#: The fields read as they are named in config.json, each through its type (the others need
#: more: an alias, a derived layout, the rope, the quantisation block).
_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
)  # fmt: skip
_PLAIN: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(_INTS, int),
    "routed_scaling_factor": float,
    "rms_norm_eps": float,
    "norm_topk_prob": bool,
    "tie_word_embeddings": bool,
    "attention_bias": bool,
    "hidden_act": str,
}


def _hf(d: dict[str, Any], key: str) -> Any:
    """``d[key]``, or transformers' default for it when the config.json leaves it out."""
    return d[key] if key in d else HF_DEFAULTS[key]


def _routed_experts(d: dict[str, Any]) -> Any:
    """The routed expert count as transformers reads it: ``num_experts`` (its BC alias) over
    ``n_routed_experts``, ``num_local_experts`` (its attribute map's name) when that is absent."""
    if d.get("num_experts") is not None:
        return d["num_experts"]
    if "n_routed_experts" not in d and "num_local_experts" in d:
        return d["num_local_experts"]
    return _hf(d, "n_routed_experts")


#: The gate activations corpusd's MLPs compute, by transformers' ACT2FN names
#: (``corpusd.model.layers.ACTIVATIONS`` has each one's function).
ACTS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu",
        "relu", "sigmoid", "tanh")  # fmt: skip


def _refuse_unserved(d: dict[str, Any]) -> None:
    """ModelConfigError naming the first field of ``d`` whose value corpusd's model does not
    compute (served, such a value gave other logits than transformers' without an error).
    ``mlp_bias`` is accepted either way: transformers' DeepSeek-V3.2 MLPs take no bias from it."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ModelConfigError(
            f"partial_rotary_factor {prf} is not served: corpusd rotates all qk_rope_head_dim dims"
        )
    act = d.get("hidden_act", "silu")
    if act not in ACTS:
        raise ModelConfigError(
            f"hidden_act {act!r} is not served: corpusd's MLPs compute {', '.join(ACTS)}"
        )
