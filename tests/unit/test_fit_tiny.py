"""tools/fit_tiny.py: its training forward is the model's, a short fit learns, and the checkpoint
it writes loads in our loader and in the transformers oracle with the same logits."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from corpusd.model import KVCache, forward_tokens, load_model
from corpusd.model.checkpoint import read_state_dict
from corpusd.testing.numeric import rel
from indexer import index_scores
from tools.fit_tiny import (
    FitConfig,
    fit,
    index_kl,
    index_log_probs,
    reinit,
    text_tokens,
    train_forward,
    train_logits,
)


def test_train_forward_matches_forward_tokens(tiny_model) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 256, (tiny_model.cfg.index_topk,), generator=gen)
    ref = forward_tokens(tiny_model, toks, KVCache(tiny_model.cfg, len(toks), torch.float32))
    assert ref is not None
    with torch.no_grad():
        got = train_logits(tiny_model, toks)
    assert rel(got, ref) <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_index_distribution_is_the_inference_indexers_score(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """The indexer is trained on the score it selects by at inference (``indexer.index_scores``,
    exact arithmetic), softmaxed over each row's causal keys."""
    n = 40
    toks = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5))
    cos, sin = tiny_model.rotary.cos_sin(torch.arange(n))
    x = tiny_model.model.embed_tokens(toks)
    layer = tiny_model.layers[0]
    with torch.no_grad():
        proj = layer.project(x, cos, sin)
        scale = tiny_model.cfg.index_head_dim**-0.5
        ref = index_scores(proj.index_q, proj.index_w, proj.index_key, scale, "exact")
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        ref = ref.masked_fill(future, float("-inf")).log_softmax(-1)
        got = index_log_probs(proj.index_q, proj.index_w, proj.index_key, scale)
    assert torch.equal(got.isinf(), future)
    assert rel(got[~future], ref[~future]) <= 1e-5


def test_index_loss_trains_the_indexer_alone(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """As in DSA's warm-up: the KL reaches only the indexer's weights, next-token loss all but
    them; the KL is zero exactly when the indexer's distribution is the attention's."""
    model = copy.deepcopy(tiny_model).train()
    toks = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(7))
    logits, kl = train_forward(model, toks, index_loss=True)
    assert kl is not None and kl.item() > 0
    kl.backward()
    for name, p in model.named_parameters():
        got = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert got == (".indexer." in name), f"{name}: {'a' if got else 'no'} KL gradient"
        p.grad = None
    F.cross_entropy(logits[:-1], toks[1:]).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)

    index = [p for n, p in model.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(index, lr=1e-2)
    kls = []
    for _ in range(20):  # the main model fixed: the indexer alone fits its attention
        _, kl = train_forward(model, toks, index_loss=True)
        assert kl is not None
        kls.append(kl.item())
        opt.zero_grad()
        kl.backward()
        opt.step()
    assert kls[-1] < 0.5 * kls[0], kls

    layer, n = model.layers[0], 8
    cos, sin = model.rotary.cos_sin(torch.arange(n))
    x = model.model.embed_tokens(toks[:n])
    attn = layer.self_attn
    with torch.no_grad():  # the indexer's own distribution as the target: KL 0
        h = layer.input_layernorm(x)
        iq, iw, ik = attn.indexer.project(h, attn.q_a_layernorm(attn.q_a_proj(h)), cos, sin)
        own = index_log_probs(iq, iw, ik, attn.indexer.scale).exp()
        assert abs(float(index_kl(layer, x, cos, sin, own[:, None, :]))) <= 1e-5


def test_fit_lowers_loss_and_writes_a_loadable_checkpoint(sglang_dir: Path, tmp_path: Path) -> None:
    # fit_tiny fits the checkpoints SGLang runs use (tools/bench_sglang.py): the sglang preset,
    # byte tokens, so the six steps below see a 64-token window of the repeated line.
    tiny_dir = sglang_dir
    text = tmp_path / "notes.md"
    text.write_text("The holder keeps the pinned pages; the requester merges partials.\n" * 8)
    out = tmp_path / "fitted"
    cfg = FitConfig(str(tiny_dir), str(out), text=(str(text),), steps=6, seq_len=64, lr=3e-3,
                    warmup=1, log_every=100)  # fmt: skip
    tokens = text_tokens([text])
    before = load_model(tiny_dir)
    r = fit(cfg)
    assert len(r.index_kl) == 6, r.index_kl  # its fall is tested alone: here the target moves
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
        kept = name.endswith("e_score_correction_bias")
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


def test_reinit_gives_small_weights_scaled_residual_writers_and_unit_norms(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """``--reinit STD``: a trainable start (the random checkpoints' unit-variance scores
    saturate attention); the model still runs, its scores now small."""
    model = copy.deepcopy(tiny_model)
    reinit(model, 0.02, seed=1)
    layers = len(model.layers)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight")):
            assert bool((p == 1).all()), name
        elif p.dim() < 2:
            assert bool((p == 0).all()), name
        else:
            want = (
                0.02 / (2 * layers) ** 0.5
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else 0.02
            )
            sd = float(p.detach().std())
            assert abs(sd / want - 1) < 0.2, (name, sd, want)
    with torch.no_grad():
        logits = train_logits(model, torch.tensor([1, 5, 9, 12, 7]))
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) < 0.5
    with pytest.raises(ValueError, match="--reinit"):
        FitConfig("src", "out", reinit=-1.0)
