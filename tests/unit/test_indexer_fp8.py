"""The fp8 indexer arithmetic (indexer/fp8.py) against plain definitions, and the model's use of it.

SGLang's own kernels (``rotate_activation``, ``act_quant``) are compared with it on a GPU in
tests/test_sglang_gpu.py; these CPU tests hold it to the written definitions."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import corpusd.model.model as mm
from corpusd.model.config import ModelConfig, ModelConfigError
from corpusd.model.model import KVCache, forward_tokens, select_rows
from indexer import fp8, index_scores, select_topk


def _hadamard_by_definition(d: int) -> torch.Tensor:
    """``H[i, j] = (-1)^popcount(i & j) / sqrt(d)``: the Sylvester (natural) order."""
    i = torch.arange(d)
    bits = torch.tensor([bin(v).count("1") for v in (i[:, None] & i[None, :]).flatten().tolist()])
    return (1 - 2 * (bits % 2)).view(d, d).float() / d**0.5


def test_hadamard_is_the_sylvester_matrix_and_its_own_inverse() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 128, generator=g)
    assert torch.allclose(fp8.hadamard(x), x @ _hadamard_by_definition(128), atol=1e-5)
    assert torch.allclose(fp8.hadamard(fp8.hadamard(x)), x, atol=1e-5)
    # orthogonal: exact dot products are unchanged
    k = torch.randn(7, 128, generator=g)
    assert torch.allclose(fp8.hadamard(x) @ fp8.hadamard(k).T, x @ k.T, atol=1e-4)
    with pytest.raises(AssertionError, match="power-of-two"):
        fp8.hadamard(torch.zeros(3, 96))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_follows_act_quant(ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 256, generator=g) * torch.logspace(-6, 2, 9)[:, None]
    q, scale = fp8.quantize(x, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (9, 2)
    amax = x.unflatten(-1, (2, 128)).abs().amax(-1)
    want = amax.clamp(min=1e-4) / 448
    if ue8m0:  # the smallest power of two ≥ amax / 448
        assert torch.equal(torch.log2(scale), torch.log2(scale).round())
        assert bool((scale >= want).all()) and bool((scale < 2 * want).all())
    else:
        assert torch.equal(scale, want)
    assert float(q.float().abs().max()) <= 448
    back = fp8.dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, or of the subnormal step
    err = (back - x).abs()
    bound = torch.maximum(x.abs() / 16, scale.repeat_interleave(128, -1) * 2**-10)
    assert bool((err <= bound).all())


def test_fp8_scores_are_dot_products_of_rotated_quantised_inputs() -> None:
    g = torch.Generator().manual_seed(2)
    q, w = torch.randn(3, 4, 128, generator=g), torch.randn(3, 4, generator=g)
    keys = torch.randn(50, 128, generator=g)
    h = _hadamard_by_definition(128)

    def view(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:  # written out, not via indexer.fp8
        r = (x.bfloat16().float() @ h).bfloat16().float()
        s = r.abs().amax(-1, keepdim=True) / 448
        if ue8m0:  # queries: act_quant's power-of-two scales
            s = torch.exp2(torch.ceil(torch.log2(s)))
        return (r * (1 / s)).to(torch.float8_e4m3fn).float() * s

    dots = torch.einsum("nhd,td->nht", view(q, True), view(keys, False))
    want = (w[:, :, None] * torch.relu(dots)).sum(1)
    got = index_scores(q, w, keys, 1.0, "fp8")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    exact = index_scores(q, w, keys, 1.0)
    assert not torch.allclose(got, exact, rtol=1e-3), "fp8 arithmetic changed nothing"


def test_index_arith_round_trips_through_config_json(sglang_dir: Path) -> None:
    # fp8 quantises 128-wide key blocks: the SGLang-shaped preset's 64 × 128 indexer
    d = json.loads((sglang_dir / "config.json").read_text())
    assert "index_arith" not in d, "an exact model's config.json is transformers' own"
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.index_arith == "exact"
    fp = replace(cfg, index_arith="fp8")
    assert fp.to_hf_dict()["index_arith"] == "fp8"
    assert ModelConfig.from_hf_dict(fp.to_hf_dict()) == fp
    with pytest.raises(ModelConfigError, match="index_arith must be"):
        ModelConfig.from_hf_dict({**d, "index_arith": "int4"})
    with pytest.raises(ModelConfigError, match="128-wide"):
        replace(cfg, index_arith="fp8", index_head_dim=64)


def test_fp8_model_selects_by_fp8_scores(sglang_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The pin prefill (``forward_tokens``) of an fp8 model selects what fp8 scores say, and
    that is not the exact model's selection; its logits differ from the exact model's."""
    from corpusd.model import load_model

    tiny_model = load_model(sglang_dir)
    fp = copy.copy(tiny_model)
    fp.cfg = replace(tiny_model.cfg, index_arith="fp8")
    cfg = fp.cfg
    n = cfg.index_topk * 3
    toks = torch.randint(2, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(4))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(c, proj, keys, positions, kernels=None):  # type: ignore[no-untyped-def]
        out = select_rows(c, proj, keys, positions, kernels)
        if c.index_arith == "fp8" and int(positions.max()) >= c.index_topk:
            want = select_topk(
                index_scores(proj.index_q, proj.index_w, keys, c.index_head_dim**-0.5, "fp8"),
                c.index_topk,
                positions + 1,
            )
            exact = select_rows(replace(c, index_arith="exact"), proj, keys, positions)
            seen.append((out, want))
            seen.append((out, exact))
        return out

    monkeypatch.setattr(mm, "select_rows", spy)
    logits = []
    for m in (fp, tiny_model):
        cache = KVCache(m.cfg, n, torch.float32)
        out = forward_tokens(m, toks, cache)
        assert out is not None
        logits.append(out[-1])
    assert seen, "no selection happened past index_topk"
    assert all(torch.equal(a, b) for a, b in seen[0::2])
    assert not all(torch.equal(a, b) for a, b in seen[1::2]), "fp8 picked the exact keys"
    assert not torch.allclose(logits[0], logits[1])
