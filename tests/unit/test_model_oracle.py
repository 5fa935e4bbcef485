"""Our model against transformers' DeepseekV32ForCausalLM on the same tiny weights (CPU, fp32)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from corpusd.model import KVCache, forward_tokens
from corpusd.model.rope import Rotary
from corpusd.testing.numeric import rel
from corpusd.testing.oracle import lowest_position_ties

# Context lengths: below index_topk (dense), and several times above it (sparse: selection real).
SHORT, LONG = 100, 520


def _tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


def _hf_forward(hf_model, toks: torch.Tensor):  # type: ignore[no-untyped-def]
    """transformers under corpusd's tie rule; the tiny preset's 16 index heads leave no exact
    tie at a cut on these prompts (asserted, so a change of preset that brings ties shows)."""
    with torch.no_grad(), lowest_position_ties() as ties:
        out = hf_model(toks[None], use_cache=True)
    assert ties.total == 0, f"exact ties at the cut: {ties.rows}"
    return out


def test_rope_tables_match_transformers(tiny_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    pos = torch.arange(0, 5000, 7)
    cos, sin = Rotary(tiny_model.cfg).cos_sin(pos)
    ref_cos, ref_sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos[None])
    half = cos.shape[1]
    assert torch.equal(cos, ref_cos[0, :, :half]) and torch.equal(sin, ref_sin[0, :, :half])


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_prefill_cache_rows_match_transformers_cache(tiny_model, hf_model, length: int) -> None:  # type: ignore[no-untyped-def]
    toks = _tokens(length, seed=length)
    cache = KVCache(tiny_model.cfg, 32, torch.float32)
    for start in range(0, length, 64):  # chunked, as pin does
        forward_tokens(tiny_model, toks[start : start + 64], cache, want_logits=False)
    out = _hf_forward(hf_model, toks)
    for li, layer in enumerate(out.past_key_values.layers):
        ref_latent = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)
        got = cache.latent[li][:length]
        assert got.shape == ref_latent.shape == (length, 576)
        assert (got - ref_latent).abs().max() <= 1e-4, f"{li=}"
        ref_index = layer.indexer_keys[0]
        assert (cache.index_keys[li][:length] - ref_index).abs().max() <= 1e-4, f"{li=}"


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_absorbed_decode_matches_full_forward(tiny_model, hf_model, length: int) -> None:  # type: ignore[no-untyped-def]
    toks = _tokens(length + 1, seed=1000 + length)
    cache = KVCache(tiny_model.cfg, 64, torch.float32)
    forward_tokens(tiny_model, toks[:length], cache, want_logits=False)
    logits = forward_tokens(tiny_model, toks[length:], cache)
    assert logits is not None
    ref = _hf_forward(hf_model, toks).logits[0, -1]
    assert rel(logits[0], ref) <= 1e-4
    assert int(logits[0].argmax()) == int(ref.argmax())


def test_sparse_regime_really_selects(tiny_model, hf_model) -> None:  # type: ignore[no-untyped-def]
    """At LONG context the top-k drops most positions: dense attention must give other logits,
    so the sparse match above is not a dense match in disguise."""
    toks = _tokens(LONG + 1, seed=7)
    dense = copy.copy(tiny_model)
    dense.cfg = replace(tiny_model.cfg, index_topk=10**6)
    outs = []
    for m in (tiny_model, dense):
        cache = KVCache(m.cfg, LONG + 1, torch.float32)
        logits = forward_tokens(m, toks, cache)
        assert logits is not None
        outs.append(logits[-1])
    ref = _hf_forward(hf_model, toks).logits[0, -1]
    assert rel(outs[0], ref) <= 1e-4
    assert rel(outs[1], ref) > 1e-2, "dense and sparse attention agree: selection is not exercised"
