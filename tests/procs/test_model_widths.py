"""Checkpoints that transformers wrote, with other widths and counts than the tiny default: rope
width, latent width, head count and MoE layout all differ, and a corpus pinned over real holder
processes decodes token for token as transformers' ``generate`` on [corpus + suffix].

Issue 20: with qk_rope_head_dim != 64 a holder took the value width as kv_dim - 64 and every
routed step failed ("shape mismatch: value tensor of shape [.., 16, 224] cannot be broadcast to
indexing result of shape [.., 16, 256]"); fetch and local, which never ask a holder to attend,
were right.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from corpusd.corpus.store import PageStore
from corpusd.model import DeepseekV32, load_model
from corpusd.testing.hf_checkpoints import write_hf_checkpoint
from corpusd.testing.holders import pin_sample, start_holder
from corpusd.testing.numeric import rel
from corpusd.testing.oracle import Oracle, decode
from holder.launch import HolderProcess
from requester.config import WorkerConfig
from tests.procs.test_decode_oracle import place

transformers = pytest.importorskip(
    "transformers", reason="transformers is the test oracle: pip install -e '.[test]'"
)

CORPUS_TOKENS, NEW_TOKENS, HOLDERS = 400, 8, 2
SUFFIXES = [f"\nQ{i}: line {i * 53}?" for i in range(3)]
# index_topk 64 against a 400-token corpus: the selection is real. 16 index heads each: a key
# that every head scores <= 0 scores exactly 0 after the ReLU, and where fewer than index_topk
# keys score above 0 the cut falls among such ties, which corpusd breaks by position and
# transformers' topk its own way (with 4 or 8 heads these seeds hit such cuts).
CONFIGS: dict[str, dict[str, Any]] = {
    "rope32-latent192-h16-dense-moe-moe": dict(
        num_hidden_layers=3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=192,
        qk_rope_head_dim=32,
        qk_nope_head_dim=48,
        v_head_dim=40,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
    ),
    "rope16-latent96-h8-moe-dense-yarn": dict(
        num_hidden_layers=2,
        mlp_layer_types=["sparse", "dense"],
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=96,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=24,
        index_n_heads=16,
        index_head_dim=48,
        index_topk=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=1024,  # = factor × original: transformers warns otherwise
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=256,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "rope96-latent160-h24-dense-dense-moe": dict(
        num_hidden_layers=3,
        mlp_layer_types=["dense", "dense", "sparse"],
        num_attention_heads=24,
        num_key_value_heads=24,
        kv_lora_rank=160,
        qk_rope_head_dim=96,
        qk_nope_head_dim=16,
        v_head_dim=32,
        index_n_heads=16,
        index_head_dim=96,
        index_topk=64,
        n_routed_experts=6,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
    ),
}
# (indexer, primitive): route is what asks the holders to attend, in both indexer modes; one
# fetch run checks the pulled rows' widths.
MODES = [("replica", "route"), ("distributed", "route"), ("replica", "fetch")]


@dataclass
class Case:
    store: PageStore
    cid: str
    model: DeepseekV32
    holders: list[HolderProcess]
    oracle: Oracle  # computed at the first decode's check, from its tokens


def _oracle(model_dir: Path, corpus: torch.Tensor) -> Oracle:
    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return Oracle(hf, corpus, SUFFIXES, NEW_TOKENS)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Case]:
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir = write_hf_checkpoint(tmp / "model", **CONFIGS[request.param])
    cid = pin_sample(tmp, model_dir, tokens=CORPUS_TOKENS)
    store = PageStore(tmp / "store")
    holders: list[HolderProcess] = []
    try:
        for i in range(HOLDERS):
            holders.append(
                start_holder(
                    tmp / "store", tmp / f"holder{i}", model_dir, "--capacity-tokens", "1024"
                )
            )
        place(cid, holders, store.manifest(cid).n_pages, 1, seed=7)
        corpus = store.read_tokens(cid).to(torch.int64)
        oracle = _oracle(model_dir, corpus)
        yield Case(store, cid, load_model(model_dir, dtype=torch.float32), holders, oracle)
    finally:
        for h in holders:
            h.stop()


def test_other_widths_decode_as_transformers(case: Case) -> None:
    m = case.model.cfg
    widths = f"rope {m.qk_rope_head_dim} latent {m.kv_lora_rank} heads {m.num_attention_heads}"
    for indexer, primitive in MODES:
        cfg = WorkerConfig(indexer=indexer, primitive=primitive, trace=True)
        addresses = [h.address for h in case.holders]
        tokens, logits, w = asyncio.run(
            decode(case.model, case.store, case.cid, addresses, cfg, SUFFIXES, NEW_TOKENS)
        )
        assert {t["pick"] for t in w.trace} == {primitive}
        assert len({t["holder"] for t in w.trace}) == HOLDERS, "not every holder was used"
        for a, ((ref_tokens, ref_logits), got, got_logits) in enumerate(
            zip(case.oracle.runs(guess=tokens), tokens, logits, strict=True)
        ):
            ctx = f"{widths} {indexer=} {primitive=} agent {a}"
            assert got == ref_tokens, f"{ctx}: {got} != {ref_tokens}"
            worst = max(rel(g, r) for g, r in zip(got_logits, ref_logits, strict=True))
            assert worst <= 1e-4, f"{ctx}: logits rel {worst:.2e}"
