"""Greedy decoding with corpusd's own model in one process (``forward_tokens`` over a growing
``KVCache``): what the tools that judge a checkpoint's answers share (``tools/flip_proxy.py``,
``tools/fit_tiny.py``)."""

from __future__ import annotations

import torch

from corpusd.model import DeepseekV32, KVCache, forward_tokens


def model_device(model: DeepseekV32) -> torch.device:
    return model.model.embed_tokens.weight.device


def greedy(
    model: DeepseekV32, cache: KVCache, suffix: list[int], n: int
) -> tuple[list[int], list[float]]:
    """``n`` free-running greedy tokens after ``suffix`` and each step's top-2 margin (nats).
    Mutates ``cache``."""
    dev = model_device(model)
    logits = forward_tokens(model, torch.tensor(suffix, device=dev), cache)
    assert logits is not None
    last = logits[-1]
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(n):
        top = last.topk(2).values
        margins.append(float(top[0] - top[1]))
        tokens.append(int(last.argmax()))
        if len(tokens) == n:
            break
        step = forward_tokens(model, torch.tensor(tokens[-1:], device=dev), cache)
        assert step is not None
        last = step[-1]
    return tokens, margins
