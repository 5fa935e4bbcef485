"""What of a checkpoint's config SGLang's DeepSeek-V3.2 model computes otherwise than the config
means (to transformers, and to corpusd's pins): refused at the server's start, in one line naming
the field, instead of answers that part from both with no error.

Read in sglang 0.5.10.post1 (``srt/models/deepseek_v2.py`` and its rotary embeddings):

- its MLA projections are built with ``bias=False`` whatever ``attention_bias`` says, so the
  request's own rows would lack the biases the corpus rows corpusd pins carry;
- any rope scaling is rewritten to ``deepseek_yarn``: a ``linear`` rope is computed as yarn;
- its yarn scales cos/sin by ``mscale(f, mscale) / mscale(f, mscale_all_dim) * attn_factor``
  (``mscale`` 1, ``mscale_all_dim`` 0 when absent), where transformers takes the config's
  ``attention_factor`` if given, else that ratio only when both are set and non-zero, else
  ``mscale(f)``; and it always truncates the correction range (transformers' ``truncate``).

A gate activation other than silu SGLang refuses itself (``Unsupported activation``). An indexer
SGLang cannot prefill at all (:func:`sglang_cannot_prefill`) is refused here too: its scheduler
would otherwise die at the first prefill on a kernel's assertion.
CPU-importable: no sglang.
"""

from __future__ import annotations

from typing import Any

from corpusd.model.config import SUPPORTED_MODEL_TYPE, ModelConfig, yarn_mscale
from corpusd.model.rope import attention_factor

#: relative difference of the two cos/sin scales that counts as computing another rope
TOLERANCE = 1e-6


#: the indexer head counts DeepGEMM's ``fp8_mqa_logits`` (SGLang's fp8 prefill scoring,
#: ``nsa_indexer.py`` ``_get_topk_ragged``) takes: its host asserts ``128 % h == 0`` and
#: ``4 % (128 // h) == 0`` (tile of 128 query-head rows, sequences aligned to 4). On one H200,
#: 32 and 64 served and 8 died on that assertion (bench/results/logs/sglang-floor-128h-i8-h200.log)
FP8_INDEX_HEADS = tuple(h for h in range(1, 129) if 128 % h == 0 and 4 % (128 // h) == 0)


def sglang_cannot_prefill(index_n_heads: int) -> str | None:
    """Why SGLang 0.5.10's DeepSeek-V3.2 cannot prefill a model whose indexer has
    ``index_n_heads`` heads, or None when it can."""
    if index_n_heads in FP8_INDEX_HEADS:
        return None
    return (
        f"index_n_heads {index_n_heads}: SGLang's fp8 indexer kernel (DeepGEMM fp8_mqa_logits) "
        f"takes {', '.join(map(str, FP8_INDEX_HEADS))} heads and stops the scheduler at the "
        "first prefill on any other"
    )


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    return d.get("rope_parameters") or d.get("rope_scaling") or {}


def transformers_yarn_scale(rp: dict[str, Any]) -> float:
    """The factor transformers' yarn multiplies cos and sin by, for rope parameters ``rp``: what
    corpusd's own model computes (``corpusd.model.rope.attention_factor``, held to transformers
    by the oracle tests)."""
    rope = ModelConfig.from_hf_dict(
        {"model_type": SUPPORTED_MODEL_TYPE, "rope_parameters": {**rp, "rope_type": "yarn"}}
    ).rope
    return attention_factor(rope)


def sglang_yarn_scale(rp: dict[str, Any]) -> float:
    """The factor SGLang's ``deepseek_yarn`` multiplies cos and sin by, for ``rp``."""
    factor = float(rp.get("factor") or 1.0)
    mscale = float(rp.get("mscale", 1.0) or 0.0)
    all_dim = float(rp.get("mscale_all_dim", 0.0) or 0.0)
    scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return scale * float(rp.get("attn_factor", 1.0))


def sglang_computes_otherwise(d: dict[str, Any]) -> str | None:
    """Why SGLang's DeepSeek-V3.2 model would compute the config ``d`` (a parsed config.json)
    otherwise than it means, or None when it computes it as transformers does."""
    if d.get("attention_bias"):
        return (
            "attention_bias true: SGLang's DeepSeek-V3.2 attention has no biases (bias=False), "
            "so its own rows would lack the biases of the corpus rows corpusd pins"
        )
    rp = _rope(d)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        return f"rope_type {kind!r}: SGLang computes every scaled rope as DeepSeek's yarn"
    if rp.get("truncate") is False:
        return "yarn truncate false: SGLang's yarn always truncates its correction range"
    ours, theirs = transformers_yarn_scale(rp), sglang_yarn_scale(rp)
    if abs(ours - theirs) > TOLERANCE * abs(ours):
        fields = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if k in rp]
        return (
            f"yarn {', '.join(fields) or 'defaults'}: SGLang scales cos/sin by {theirs:.6g} where "
            f"the config means {ours:.6g} (it reads mscale / mscale_all_dim and attn_factor, "
            "not attention_factor)"
        )
    return None
