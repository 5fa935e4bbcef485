"""``tools/sglang_oracle.py``: the bench's float64 reference gives, for each request and forced
step, the next-token log-softmax of exactly the context the servers are asked about (the corpus
prefilled once and continued per request equals one forward over the whole sequence), and reads
each run against it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from corpusd.model import load_model
from corpusd.model.model import KVCache, forward_tokens
from corpusd.model.tiny import init_tiny
from tools.sglang_oracle import oracle_forced, vs_oracle


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SGLang preset shrunk (its fp8 index arithmetic kept): 8 heads, hidden 64."""
    out = tmp_path_factory.mktemp("oracle") / "model"
    init_tiny(out, seed=3, preset="sglang", num_attention_heads=8, hidden_size=64,
              q_lora_rank=32, index_topk=64, index_arith="fp8")  # fmt: skip
    return out


def test_the_oracle_asks_what_the_servers_are_asked(fp8_model: Path) -> None:
    g = torch.Generator().manual_seed(5)
    corpus = [2, *torch.randint(3, 250, (700,), generator=g).tolist()]  # > CHUNK: two chunks
    suffixes = [[40, 41, 42], [50, 51]]
    answers = [[60, 61, 62, 63], [70, 71, 72, 73]]
    got = oracle_forced(fp8_model, corpus, suffixes, answers, 3, device="cpu")
    assert [len(r) for r in got] == [3, 3] and len(got[0][0]) > 256
    model = load_model(fp8_model, dtype=torch.float64)
    for sfx, ans, rows in zip(suffixes, answers, got, strict=True):
        seq = corpus + sfx + ans[:2]
        cache = KVCache(model.cfg, len(seq), torch.float64)
        with torch.no_grad():
            logits = forward_tokens(model, torch.tensor(seq), cache)
        assert logits is not None
        for j in range(3):  # step j predicts ans[j] from corpus + question + ans[:j]
            ref = logits[len(corpus) + len(sfx) - 1 + j].double().log_softmax(-1)
            assert torch.allclose(torch.tensor(rows[j], dtype=torch.float64), ref, atol=1e-9)
            assert math.isclose(sum(math.exp(x) for x in rows[j]), 1.0, rel_tol=1e-9)


def test_runs_are_read_against_the_oracle_and_route_over_stock() -> None:
    oracle = [[[math.log(0.7), math.log(0.2), math.log(0.1)]]]
    stock = [[[math.log(0.69), math.log(0.21), math.log(0.1)]]]
    route = [[[math.log(0.68), math.log(0.22), math.log(0.1)]]]
    out = vs_oracle(oracle, {"stock": stock, "route": route, "missing": None})
    assert set(out) == {"stock", "route", "route_over_stock"}
    assert out["stock"]["forced_agree_steps"] == out["route"]["forced_agree_steps"] == 1
    ratio = out["route_over_stock"]["logprob_max_abs_diff"]
    want = abs(math.log(0.22) - math.log(0.2)) / abs(math.log(0.21) - math.log(0.2))
    assert math.isclose(ratio, want, rel_tol=1e-9)
    assert vs_oracle(oracle, {"stock": oracle})["stock"]["logprob_max_abs_diff"] == 0.0
