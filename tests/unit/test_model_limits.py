"""A DeepSeek-V3.2 config that corpusd cannot serve is refused when its config.json is read (by
pin, the holder and the agent alike), with one line naming the field; never mid-decode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from corpusd.model import ModelConfig, ModelConfigError
from corpusd.model.config import ACTS, HF_DEFAULTS
from corpusd.model.layers import ACTIVATIONS
from corpusd.testing.hf_checkpoints import BASE

transformers = pytest.importorskip(
    "transformers", reason="transformers writes the configs: pip install -e '.[test]'"
)

SMALL: dict[str, Any] = dict(
    num_hidden_layers=2,
    mlp_layer_types=["dense", "sparse"],
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
)


def _write(tmp: Path, **override: Any) -> Path:
    cfg = transformers.DeepseekV32Config(**(BASE | SMALL | override))
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict()))
    return tmp


def test_a_small_transformers_config_is_served(tmp_path: Path) -> None:
    c = ModelConfig.from_dir(_write(tmp_path))
    assert (c.kv_dim, c.kv_lora_rank, c.qk_rope_head_dim) == (80, 64, 16)


def test_more_heads_than_flashmla_takes_a_call_are_served(tmp_path: Path) -> None:
    """160 heads load (it used to be refused at 128, FlashMLA's limit a call; the holder now runs
    FlashMLA per group of 128 heads)."""
    c = ModelConfig.from_dir(_write(tmp_path, num_attention_heads=160, num_key_value_heads=160))
    assert c.num_attention_heads == 160


@pytest.mark.parametrize(
    "override, message",
    [
        (
            dict(num_attention_heads=1040, num_key_value_heads=1040),
            "num_attention_heads 1040 > 1024",
        ),
        (dict(kv_lora_rank=0), "must be > 0: kv_lora_rank 0"),
        (dict(index_n_heads=0), "must be > 0: index_n_heads 0"),
        (dict(n_group=0), "MoE layers need n_group"),
        (dict(index_head_dim=8), "index_head_dim 8 < qk_rope_head_dim 16"),
    ],
)
def test_an_unservable_config_is_refused_at_load(
    tmp_path: Path, override: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelConfigError, match=message) as e:
        ModelConfig.from_dir(_write(tmp_path, **override))
    assert "\n" not in str(e.value), f"one line: {e.value}"


@pytest.mark.parametrize("name", ACTS)
def test_every_served_activation_is_transformers_own(name: str) -> None:
    """Each ``hidden_act`` corpusd serves computes what transformers' ACT2FN does under that
    name (the end-to-end decode runs a few: tests/procs/test_model_knobs.py)."""
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 4001, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS[name](x), ACT2FN[name](x), rtol=1e-6, atol=1e-6)


def test_num_experts_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """transformers' DeepseekV32Config takes ``num_experts`` (a BC alias) over
    ``n_routed_experts``; a config.json written with it alone is served with that count."""
    d = json.loads(_write(tmp_path).joinpath("config.json").read_text())
    want = transformers.DeepseekV32Config(**{**d, "num_experts": 6}).n_routed_experts
    del d["n_routed_experts"]
    (tmp_path / "config.json").write_text(json.dumps({**d, "num_experts": 6}))
    assert ModelConfig.from_dir(tmp_path).n_routed_experts == want == 6


def test_num_local_experts_names_the_routed_experts_as_in_transformers(tmp_path: Path) -> None:
    """``num_local_experts`` is transformers' attribute-map name for ``n_routed_experts``."""
    d = json.loads(_write(tmp_path).joinpath("config.json").read_text())
    del d["n_routed_experts"]
    d["num_local_experts"] = 6
    assert transformers.DeepseekV32Config(**d).n_routed_experts == 6
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_dir(tmp_path).n_routed_experts == 6


def test_the_defaults_are_transformers_own() -> None:
    c = transformers.DeepseekV32Config()
    for key, value in HF_DEFAULTS.items():
        got = c.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(c, key)
        assert got == value, f"{key}: transformers {got!r}, corpusd {value!r}"


@pytest.mark.parametrize("small", [True, False], ids=["small", "v3.2-sized"])
def test_a_key_left_out_means_what_it_means_to_transformers(small: bool) -> None:
    """A valid config.json may leave out any key transformers has a default for. Read without
    every key at its default, it is the same config as written in full. Before, the sizes were
    refused as missing, and n_group, topk_group and routed_scaling_factor were read as 1, 1 and
    1.0 (transformers: 8, 4, 2.5): other routing, other logits, no error."""
    full = transformers.DeepseekV32Config(**(BASE | SMALL if small else {})).to_dict()
    sparse = {k: v for k, v in full.items() if k not in HF_DEFAULTS or v != HF_DEFAULTS[k]}
    if full["rope_parameters"] == {"rope_type": "default", "rope_theta": HF_DEFAULTS["rope_theta"]}:
        del sparse["rope_parameters"]
    if not small:  # transformers derives it from first_k_dense_replace (SMALL gives its own)
        del sparse["mlp_layer_types"]
    assert len(sparse) <= len(full) - 10
    want = ModelConfig.from_hf_dict(full)
    assert ModelConfig.from_hf_dict(sparse) == want
    theirs = transformers.DeepseekV32Config(**sparse)
    assert (want.n_group, want.topk_group, want.routed_scaling_factor) == (
        theirs.n_group, theirs.topk_group, theirs.routed_scaling_factor,
    )  # fmt: skip
