"""config.json values a valid DeepSeek-V3.2 config may carry but the drawn configs
(``hf_checkpoints.draw_config``) leave at their defaults. Each is either served, giving
transformers' ``generate`` tokens and logits through two real holder processes, or refused at
load in one line naming its field. Before this test, ``hidden_act: gelu`` was served silently,
and its logits were 12 % off. ``tie_word_embeddings: true`` and ``attention_bias: true`` failed
in the checkpoint reader, naming weights rather than the field."""

from __future__ import annotations

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
]
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
]


@pytest.mark.parametrize("extra", SERVED, ids=[next(iter(e)) for e in SERVED])
def test_a_knob_corpusd_computes_decodes_as_transformers(
    extra: dict[str, Any], tmp_path: Path
) -> None:
    r = run_config(tmp_path, Drawn(0, draw_config(0).overrides | extra))
    assert r.status == "ok", f"{extra}: {r.status}: {r.detail}"


@pytest.mark.parametrize(("extra", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_a_knob_corpusd_does_not_compute_is_refused_naming_it(
    extra: dict[str, Any], field: str, tmp_path: Path
) -> None:
    r = run_config(tmp_path, Drawn(0, draw_config(0).overrides | extra))
    assert r.status == "refused" and field in r.detail and "\n" not in r.detail, r.detail
