"""tools/fit_fast.py: the batched training forward in MLA's per-head form gives the reference
forward's logits (absorbed form, one sequence at a time) for every sequence of a batch, and its
indexer KL on sampled rows is the reference KL restricted to those rows, reaching only the
indexer's weights."""

from __future__ import annotations

import torch

from corpusd.model import DeepseekV32
from corpusd.testing.numeric import rel
from tools.fit_fast import train_forward_batch
from tools.fit_tiny import _future, causal_probs, index_log_probs, train_forward


def test_batched_per_head_forward_equals_the_reference(tiny_model: DeepseekV32) -> None:
    g = torch.Generator().manual_seed(11)
    toks = torch.randint(0, 256, (3, 96), generator=g)
    with torch.no_grad():
        got, kl = train_forward_batch(tiny_model, toks)
        for i in range(3):
            want, _ = train_forward(tiny_model, toks[i])
            assert rel(got[i], want) <= 1e-5, i
            assert torch.equal(got[i].argmax(-1), want.argmax(-1))
    assert kl is None


def test_padding_at_the_end_leaves_earlier_positions_alone(tiny_model: DeepseekV32) -> None:
    g = torch.Generator().manual_seed(12)
    a = torch.randint(0, 256, (1, 64), generator=g)
    padded = torch.cat([a, torch.zeros(1, 20, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        short, _ = train_forward_batch(tiny_model, a)
        long, _ = train_forward_batch(tiny_model, padded)
    assert rel(long[:, :64], short) <= 1e-6


def _reference_kl_on_rows(model: DeepseekV32, toks: torch.Tensor, rows: torch.Tensor) -> float:
    """fit_tiny's per-layer KL (index_kl), its mean taken over ``rows`` only, summed over layers."""
    cfg = model.cfg
    n = toks.shape[0]
    cos, sin = model.rotary.cos_sin(torch.arange(n))
    x = model.model.embed_tokens(toks)
    total = 0.0
    for layer in model.layers:
        proj = layer.project(x, cos, sin)
        p = causal_probs(proj.q, proj.cache_row, cfg.softmax_scale)
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
        iq, iw, ik = attn.indexer.project(h, q_resid, cos, sin)
        logq = index_log_probs(iq, iw, ik, attn.indexer.scale)
        target = p.sum(dim=1)
        target = target / target.sum(dim=-1, keepdim=True)
        future = _future(n, toks.device)
        kl = torch.special.xlogy(target, target) - target * logq.masked_fill(future, 0.0)
        total += float(kl.sum(dim=-1)[rows].mean())
        o = torch.einsum("nhk,kv->nhv", p, proj.cache_row[:, : cfg.kv_lora_rank].float())
        x = layer.finish(x, o.to(proj.q.dtype))
    return total


def test_sampled_row_index_kl_is_the_reference_kl_on_those_rows(tiny_model: DeepseekV32) -> None:
    g = torch.Generator().manual_seed(13)
    toks = torch.randint(0, 256, (2, 80), generator=g)
    rows_gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        _, kl = train_forward_batch(tiny_model, toks, index_rows=16, generator=rows_gen)
        rows = torch.randperm(80, generator=torch.Generator().manual_seed(5))[:16].sort().values
        want = sum(_reference_kl_on_rows(tiny_model, toks[i], rows) for i in range(2)) / 2
    assert kl is not None and abs(float(kl) - want) <= 1e-4 * max(1.0, abs(want))


def test_the_sampled_kl_reaches_only_the_indexer(tiny_model: DeepseekV32) -> None:
    toks = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(14))
    tiny_model.zero_grad(set_to_none=True)
    _, kl = train_forward_batch(tiny_model, toks, index_rows=8)
    assert kl is not None
    kl.backward()
    grads = {
        n for n, p in tiny_model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0
    }
    assert grads and all(".indexer." in n for n in grads), sorted(grads)[:5]
    tiny_model.zero_grad(set_to_none=True)


def test_fast_step_gives_the_reference_steps_losses_and_gradients(tiny_model: DeepseekV32) -> None:
    """fit_tiny's two step functions on the same span-like batch (unequal lengths, weighted
    answers): the same loss, answers' loss and gradients; the index KL left out (the fast one
    samples rows)."""
    import copy

    from tools.fit_tiny import FitConfig, fast_step, reference_step

    cfg = FitConfig(src="-", out="-", batch=2, index_weight=0.0)
    g = torch.Generator().manual_seed(15)
    seqs = []
    for n in (70, 55):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        answer = [i >= n - 12 for i in range(1, n)]
        seqs.append((ids, [4.0 if a else 1.0 for a in answer], answer))
    a, b = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    ref = reference_step(a, seqs, cfg, with_index=False)
    got = fast_step(b, seqs, cfg, False, torch.Generator().manual_seed(0))
    assert abs(got[0] - ref[0]) <= 1e-5 and abs(got[2] - ref[2]) <= 1e-5 and got[1] == ref[1] == 0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if pa.grad is None:
            assert pb.grad is None or not pb.grad.any(), name
            continue
        assert pb.grad is not None and rel(pb.grad, pa.grad) <= 1e-4, name
