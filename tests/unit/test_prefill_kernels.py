"""``corpusd.model.prefill_kernels``: which prefill kernels run, and that ``forward_tokens``
uses them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from corpusd.corpus.config import PinConfig
from corpusd.kernels.reference import partial_attention
from corpusd.model import KVCache, forward_tokens
from corpusd.model.prefill_kernels import Kernels, choose
from corpusd.model.tiny import build_tiny
from indexer import index_scores


def test_cpu_and_torch_choose_the_references() -> None:
    cfg = build_tiny(preset="sglang").cfg
    for device, want in (("cpu", "auto"), ("cpu", "torch"), ("cuda:0", "torch")):
        k = choose(cfg, device, torch.bfloat16, want)
        assert k.scores is index_scores and k.attend is partial_attention, (device, want)
        assert k.describe == "torch index scores, torch sparse attention"
    with pytest.raises(ValueError, match="unknown prefill kernels 'fast': one of auto, torch"):
        choose(cfg, "cpu", torch.float32, "fast")
    with pytest.raises(ValueError, match="kernels must be one of"):
        PinConfig(corpus="x.tar", kernels="fast")


def test_auto_says_why_a_gpu_kernel_is_not_used() -> None:
    """``corpusd pin`` prints the kernels; where auto falls back on CUDA it says why, in the
    registry's words (this machine has no GPU: every reason below is one a user can act on)."""
    import importlib.util

    cfg = build_tiny(preset="sglang").cfg
    no_gpu = "no CUDA GPU" if importlib.util.find_spec("triton") else "no Triton"
    k = choose(cfg, "cuda:0", torch.float32)
    assert k.describe == (
        f"torch index scores ({no_gpu}), torch sparse attention (flashmla needs a bfloat16 model "
        "with 576-wide latent rows (d_v 512): it does not fit a torch.float32 pool of width 576 "
        "(d_v 512); triton needs a CUDA GPU and Triton)"
    )
    bf16 = torch.bfloat16
    assert "(flashmla needs an SM90 GPU and sgl_kernel;" in choose(cfg, "cuda:0", bf16).describe
    narrow = replace(cfg, kv_lora_rank=256)
    why = choose(narrow, "cuda", bf16).describe
    assert "does not fit a torch.bfloat16 pool of width 320" in why, why


def test_auto_attends_with_the_registrys_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill takes its attention kernel from ``corpusd.kernels.registry.choose``, the rule
    the holders and the plugin use: with both GPU kernels usable (faked here) a bf16 576-wide
    model gets the per-request ``flashmla|triton``, a float32 one Triton."""
    from corpusd.kernels import registry

    for name in ("flashmla", "triton"):
        monkeypatch.setitem(
            registry.REGISTRY, name, replace(registry.REGISTRY[name], available=lambda d: True)
        )
    cfg = build_tiny(preset="sglang").cfg
    k = choose(cfg, "cuda:0", torch.bfloat16)
    assert k.describe.endswith(f"flashmla|triton sparse attention ({registry.PER_REQUEST_RULE})")
    assert k.attend is not partial_attention
    f32 = choose(cfg, "cuda:0", torch.float32)
    assert f32.attend is registry.REGISTRY["triton"].fn, f32.describe
    assert "triton sparse attention (flashmla needs a bfloat16 model" in f32.describe


def test_forward_tokens_runs_the_given_kernels() -> None:
    """Spies that call the references: every layer past index_topk scores and attends through
    them, and the cache and logits are those of the default path, bit for bit."""
    model = build_tiny(preset="sglang", index_topk=16)
    calls = {"scores": 0, "attend": 0}

    def scores(*a: object, **k: object) -> torch.Tensor:
        calls["scores"] += 1
        return index_scores(*a, **k)  # type: ignore[arg-type]

    def attend(*a: object, **k: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls["attend"] += 1
        return partial_attention(*a, **k)  # type: ignore[arg-type]

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (40,), generator=g)
    runs = []
    for kernels in (None, Kernels(scores, attend, "spies")):
        cache = KVCache(model.cfg, 40, torch.float32)
        forward_tokens(model, tokens[:20], cache, False, kernels)
        logits = forward_tokens(model, tokens[20:], cache, True, kernels)
        runs.append((cache, logits))
    layers = model.cfg.num_hidden_layers
    assert calls == {"scores": 2 * layers, "attend": 2 * layers}
    (a, la), (b, lb) = runs
    assert la is not None and lb is not None and torch.equal(la, lb)
    for li in range(layers):
        assert torch.equal(a.latent[li], b.latent[li])
        assert torch.equal(a.index_keys[li], b.index_keys[li])
