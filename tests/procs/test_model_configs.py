"""Issue 20: any valid DeepSeek-V3.2 config works everywhere. Configs drawn at random (seeded, so
a failure names its seed and reruns as ``pytest -k 'seed7'``) are saved by transformers, loaded
and pinned by corpusd, and decoded by a requester Worker through two real holder processes; the
tokens must equal transformers' ``generate`` on [corpus + suffix] and the logits agree to rel
≤ 1e-4. Then the same decode runs again with one holder SIGKILLed after two steps: its groups
fail over (the index top-k of a distributed indexer too), and not one token may change. A drawn
config corpusd cannot serve must be refused at load with one line naming the field.

Every config gets its own two holder processes (a holder serves one model directory), started
in parallel: ~5 s a config on 2 cores, so CI's 25 seeds (20 served, 5 refused) take about two
minutes. The indexer mode alternates with the seed (replica, distributed); the primitive is
route, so every attention step asks the holders. ``python -m tools.config_sweep`` runs more seeds
and records each result in bench/results/config-sweep-cpu.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corpusd.testing.config_runs import run_config
from corpusd.testing.hf_checkpoints import HEADS, draw_config

pytest.importorskip(
    "transformers", reason="transformers is the test oracle: pip install -e '.[test]'"
)

SEEDS = range(25)  # draws 20 servable configs and 5 that corpusd must refuse


def test_the_draws_cover_the_space() -> None:
    """What CI's seeds reach, so a change to the generator cannot quietly narrow them."""
    drawn = [draw_config(s) for s in SEEDS]
    served = [d.overrides for d in drawn if d.refused_field is None]
    assert len(served) >= 20
    assert {d.refused_field for d in drawn} - {None} >= {
        "num_attention_heads",
        "index_head_dim",
        "kv_lora_rank",
        "qk_rope_head_dim",
    }
    heads = {o["num_attention_heads"] for o in served}
    assert heads - {1, 2, 4, 8, 16, 32, 64, 128} and 128 in heads, heads
    assert max(heads) > 128, f"past FlashMLA's 128 heads a call: {heads}"
    assert any(o["index_n_heads"] == 8 for o in served), "8 index heads: exact ties at the cut"
    assert {o["num_hidden_layers"] for o in served} == {1, 2, 3}
    assert any("rope_parameters" in o for o in served)
    assert any("rope_parameters" not in o for o in served)
    assert any("mlp_layer_types" in o for o in served)
    assert any("first_k_dense_replace" in o for o in served)
    assert any(o["index_topk"] < 256 for o in served), "the sparse path"
    assert any(o["index_topk"] > 300 for o in served), "index_topk above the sequence"
    assert set(HEADS) >= heads


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_a_drawn_config_decodes_as_transformers_or_is_refused(seed: int, tmp_path: Path) -> None:
    drawn = draw_config(seed)
    r = run_config(tmp_path, drawn, failover=True)
    ctx = f"seed {seed}, config {json.dumps(drawn.overrides)}, indexer {r.indexer}"
    if drawn.refused_field is not None:
        assert r.status == "refused", f"{ctx}: {r.status} {r.detail}"
        assert drawn.refused_field in r.detail, f"{ctx}: the refusal does not name the field"
        assert "\n" not in r.detail, f"{ctx}: not one line: {r.detail}"
        return
    assert r.status == "ok", f"{ctx}: {r.status}: {r.detail}"
    assert r.extra["holders_used"] == 2, f"{ctx}: not every holder was used"
    assert r.extra["failover"]["killed_at_step"] is not None, f"{ctx}: no holder was killed"
