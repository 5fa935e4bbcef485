"""The SGLang plugin refuses at start a config SGLang's DeepSeek-V3.2 model computes otherwise
than it means (``requester/sglang/model_check.py``): attention biases it drops, a linear rope it
computes as yarn, a yarn scale it reads otherwise; and an indexer it cannot prefill. CPU: the
rules, and the yarn scale against transformers' own."""

from __future__ import annotations

import json
from typing import Any

import pytest

from corpusd.model.tiny import preset_config
from requester.sglang.model_check import (
    FP8_INDEX_HEADS,
    sglang_cannot_prefill,
    sglang_computes_otherwise,
    sglang_yarn_scale,
    transformers_yarn_scale,
)

V32_YARN = {  # DeepSeek-V3.2's own rope_scaling
    "rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip


def _config(**extra: Any) -> dict[str, Any]:
    d = json.loads(json.dumps(preset_config("sglang").to_hf_dict()))
    return d | extra


def test_the_served_configs_pass() -> None:
    assert sglang_computes_otherwise(_config()) is None
    for rope in (V32_YARN, {k: v for k, v in V32_YARN.items() if "mscale" not in k}):
        assert sglang_computes_otherwise(_config(rope_parameters=rope)) is None, rope
        assert sglang_computes_otherwise(_config(rope_scaling=rope, rope_parameters=None)) is None


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}, "linear"),
        ({"rope_parameters": V32_YARN | {"attention_factor": 1.3}}, "attention_factor"),
        ({"rope_parameters": {k: v for k, v in V32_YARN.items() if k != "mscale"}},
         "mscale_all_dim"),
        ({"rope_parameters": {k: v for k, v in V32_YARN.items() if k != "mscale_all_dim"}
          | {"mscale": 0.7}}, "mscale"),
        ({"rope_parameters": V32_YARN | {"truncate": False}}, "truncate"),
    ],
)  # fmt: skip
def test_what_sglang_computes_otherwise_is_named(extra: dict[str, Any], names: str) -> None:
    why = sglang_computes_otherwise(_config(**extra))
    assert why is not None and names in why, why


@pytest.mark.parametrize(
    "rope",
    [
        V32_YARN,
        {k: v for k, v in V32_YARN.items() if "mscale" not in k},
        V32_YARN | {"mscale_all_dim": 0.5},
        V32_YARN | {"attention_factor": 1.3},
        {k: v for k, v in V32_YARN.items() if k != "mscale"},
    ],
)
def test_the_yarn_scale_is_transformers_own(rope: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    cfg = transformers.DeepseekV32Config(rope_parameters={"rope_theta": 1e4, **rope})
    _, want = _compute_yarn_parameters(cfg)
    assert transformers_yarn_scale(rope) == pytest.approx(want, rel=1e-9)
    if sglang_computes_otherwise(_config(rope_parameters=rope)) is None:
        assert sglang_yarn_scale(rope) == pytest.approx(want, rel=1e-6)


def test_an_indexer_sglang_cannot_prefill_is_named() -> None:
    """8 index heads (the CPU tie config) stopped SGLang's scheduler at its first prefill on one
    H200 (DeepGEMM's assertion); 32 and 64 served there."""
    assert FP8_INDEX_HEADS == (32, 64, 128)
    for heads in (32, 64, 128):
        assert sglang_cannot_prefill(heads) is None
    for heads in (8, 16, 24, 48, 96):
        why = sglang_cannot_prefill(heads)
        assert why is not None and f"index_n_heads {heads}" in why and "32, 64, 128" in why
