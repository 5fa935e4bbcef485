"""tools/fit_tiny.py: its training forward is the model's, a short fit learns, and the checkpoint
it writes loads in our loader and in the transformers oracle with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import rel

from corpusd.model import KVCache, forward_tokens, load_model
from corpusd.model.checkpoint import read_state_dict
from tools.fit_tiny import FitConfig, fit, text_tokens, train_logits


def test_train_forward_matches_forward_tokens(tiny_model) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 256, (tiny_model.cfg.index_topk,), generator=gen)
    ref = forward_tokens(tiny_model, toks, KVCache(tiny_model.cfg, len(toks), torch.float32))
    assert ref is not None
    with torch.no_grad():
        got = train_logits(tiny_model, toks)
    assert rel(got, ref) <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_fit_lowers_loss_and_writes_a_loadable_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.md"
    text.write_text("The holder keeps the pinned pages; the requester merges partials.\n" * 8)
    out = tmp_path / "fitted"
    cfg = FitConfig(str(tiny_dir), str(out), text=(str(text),), steps=6, seq_len=64, lr=3e-3,
                    warmup=1, log_every=100)  # fmt: skip
    tokens = text_tokens([text])
    before = load_model(tiny_dir)
    fit(cfg)
    after = load_model(out)
    seq = tokens[:65]
    with torch.no_grad():
        loss = [float(F.cross_entropy(train_logits(m, seq[:-1]), seq[1:])) for m in (before, after)]
    assert loss[1] < loss[0] - 0.5, f"{loss=}: six steps on a repeated line should learn it"

    assert (out / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    old = read_state_dict(tiny_dir, before.cfg, torch.bfloat16)
    new = read_state_dict(out, after.cfg, torch.bfloat16)
    assert old.keys() == new.keys()
    for name in old:
        same = torch.equal(old[name], new[name])
        kept = ".indexer." in name or name.endswith("e_score_correction_bias")
        assert same == kept, f"{name}: {'changed' if kept else 'unchanged'} by the fit"

    transformers = pytest.importorskip("transformers", reason="transformers is the test oracle")
    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    toks = tokens[:100]
    ours = forward_tokens(after, toks, KVCache(after.cfg, 100, torch.float32))
    assert ours is not None
    with torch.no_grad():
        ref = hf(toks[None]).logits[0]
    assert rel(ours, ref) <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
