"""config.json values a valid DeepSeek-V3.2 config may carry but the drawn configs
(``hf_checkpoints.draw_config``) leave at their defaults. Each is either served, giving
transformers' ``generate`` tokens and logits through two real holder processes, or refused at
load in one line naming its field. Before this test, ``hidden_act: gelu`` was served silently,
and its logits were 12 % off. ``tie_word_embeddings: true`` and ``attention_bias: true`` failed
in the checkpoint reader, naming weights rather than the field. Since then attention biases and
the gate activations transformers names are computed (``corpusd.model.layers.ACTIVATIONS``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from corpusd.testing.config_runs import run_config
from corpusd.testing.hf_checkpoints import Drawn, draw_config

pytest.importorskip(
    "transformers", reason="transformers is the test oracle: pip install -e '.[test]'"
)

SERVED: list[dict[str, Any]] = [
    {"tie_word_embeddings": True},
    {"norm_topk_prob": False},
    {"rms_norm_eps": 1e-5},
    {"routed_scaling_factor": 1.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
    # refused until 2026-11-29 (valid configs; the biases land in the pinned rows and the query;
    # first_k_dense_replace 1: seed 0's second layer becomes MoE, so the experts' act runs too)
    {"attention_bias": True},
    {"hidden_act": "gelu", "first_k_dense_replace": 1},
    {"hidden_act": "gelu_new", "first_k_dense_replace": 1},
    {"hidden_act": "relu", "first_k_dense_replace": 1},
    {"mlp_bias": True},  # transformers' V3.2 MLPs take no bias from it: nor do corpusd's
    {"attention_bias": True, "hidden_act": "quick_gelu", "first_k_dense_replace": 1},
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "attention_factor": 1.3,
        }
    },
    {
        "rope_parameters": {
            "rope_type": "linear",
            "rope_theta": 50000.0,
            "factor": 2.0,
            "mscale_all_dim": 1.0,
        }
    },
]
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"hidden_act": "mish"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
]


def _id(extra: dict[str, Any]) -> str:
    def one(k: str, v: Any) -> str:
        if isinstance(v, dict):
            extra = [x for x in ("mscale_all_dim", "attention_factor") if x in v]
            return f"{k}={v.get('rope_type')}" + "".join(f"+{x}" for x in extra)
        return f"{k}={v}" if isinstance(v, (str, bool)) else k

    return "+".join(one(k, v) for k, v in extra.items())


@pytest.mark.parametrize("extra", SERVED, ids=[_id(e) for e in SERVED])
def test_a_knob_corpusd_computes_decodes_as_transformers(
    extra: dict[str, Any], tmp_path: Path
) -> None:
    r = run_config(tmp_path, Drawn(0, draw_config(0).overrides | extra))
    assert r.status == "ok", f"{extra}: {r.status}: {r.detail}"


@pytest.mark.parametrize(("extra", "field"), REFUSED, ids=[_id(e) for e, _ in REFUSED])
def test_a_knob_corpusd_does_not_compute_is_refused_naming_it(
    extra: dict[str, Any], field: str, tmp_path: Path
) -> None:
    r = run_config(tmp_path, Drawn(0, draw_config(0).overrides | extra))
    assert r.status == "refused" and field in r.detail and "\n" not in r.detail, r.detail


def test_a_config_json_of_only_the_keys_that_differ_decodes_as_transformers(
    tmp_path: Path,
) -> None:
    """A config.json written by hand holds only what differs from transformers' defaults, which
    fill in the rest: routed_scaling_factor 2.5 among them (this config's MoE layer), which
    corpusd read as 1.0 before, and the sizes it refused as missing."""
    extra = {"first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "index_topk": 2048}
    r = run_config(tmp_path, Drawn(0, draw_config(0).overrides | extra, minimal=True))
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert not {"routed_scaling_factor", "index_topk", "hidden_act"} & set(written), written
    assert r.status == "ok", f"{r.status}: {r.detail}"
