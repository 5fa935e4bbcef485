"""The SGLang plugin's host path overlaps the corpus's holder calls with SGLang's own partial
(issue 17, item 1): CorpusLink.begin / finish against a real coordinator and holder, and the
backend's forward with SGLang stand-ins (no sglang needed)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from corpusd.model import ModelConfig, fingerprint
from requester.sglang.link import CorpusLink
from requester.sglang.lse import merge_local_corpus
from requester.sglang.positions import to_corpusd_layout
from tests.support.sglang_cluster import TOKENS, Cluster, start_cluster
from tests.support.sglang_host import load_backend


@pytest.fixture(scope="module")
def tiny_dir(sglang_dir: Path) -> Path:
    """V3.2's 64 × 128 indexer, corpora sized in byte tokens: the sglang preset."""
    return sglang_dir


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory, tiny_dir)


def test_begin_returns_with_the_holder_calls_in_flight_and_finish_is_attend(
    cluster: Cluster, tiny_dir: Path
) -> None:
    """Issue 17: the corpus call starts before SGLang's own partial and is waited for after it.
    ``begin`` must return while the holder calls are still held back (here by a gate the test
    opens), and ``finish`` then gives attend's bits."""
    cfg = ModelConfig.from_dir(tiny_dir)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, cfg.num_attention_heads, cfg.kv_dim, generator=g).bfloat16()
    pos = torch.randint(-1, TOKENS, (3, 40), generator=g)
    link = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64)
    gate = threading.Event()
    remote = link.host._remote

    async def gated(*a: Any, **kw: Any) -> Any:
        await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        return await remote(*a, **kw)

    try:
        b = link.bind(cluster.corpus_id)
        want = link.attend(b, 1, q, pos, cfg.softmax_scale)
        link.host._remote = gated  # type: ignore[method-assign]
        p = link.begin(b, 1, q, pos, cfg.softmax_scale)
        assert not p.fut.done(), "begin waited for the holders"
        gate.set()  # the caller's own partial would run before this
        got = link.finish(p)
    finally:
        gate.set()
        link.close()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_host_path_sends_the_corpus_call_before_sglangs_partial_and_merges_after(
    cluster: Cluster, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's host path (``CorpusNSABackend._forward``, SGLang's own attention passed
    in): the holder call is in flight while SGLang's partial runs (it may not be answered
    before that partial is done: the gate opens only at its end), and the output is SGLang's
    partial merged by LSE with the link's corpus partial."""
    backend = load_backend(monkeypatch)
    cfg = ModelConfig.from_dir(tiny_dir)
    h, n = cfg.num_attention_heads, 3
    g = torch.Generator().manual_seed(9)
    q = torch.randn(n, h, cfg.kv_dim, generator=g).bfloat16()  # SGLang's layout
    pos = torch.randint(-1, TOKENS, (n, 40), generator=g)
    o_own = torch.randn(n, h * cfg.kv_lora_rank, generator=g).bfloat16()
    lse_own = torch.randn(n, h, generator=g)
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=h, v_head_dim=cfg.kv_lora_rank,
                            head_dim=cfg.kv_dim, scaling=cfg.softmax_scale)  # fmt: skip
    link = CorpusLink(cluster.coord.address, cfg, fingerprint(tiny_dir), 64)
    sent, gate = threading.Event(), threading.Event()
    remote = link.host._remote

    async def gated(*a: Any, **kw: Any) -> Any:
        sent.set()
        await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        return await remote(*a, **kw)

    def sglang_partial(*a: Any, **kw: Any) -> torch.Tensor:
        assert sent.wait(10), "SGLang's partial ran before the corpus call was sent"
        be._lse = lse_own
        gate.set()  # the holders may answer only now
        return o_own

    try:
        b = link.bind(cluster.corpus_id)
        o_cor, l_cor = link.attend(b, 1, to_corpusd_layout(q).bfloat16(), pos, cfg.softmax_scale)
        link.host._remote = gated  # type: ignore[method-assign]
        tok = torch.zeros(n, dtype=torch.int64)
        cb = backend.CorpusBatch(link, [b], tok, torch.full((n,), TOKENS), False, "decode")
        cb.corpus_sel[1] = pos
        be = backend.CorpusNSABackend()
        fb = SimpleNamespace(corpusd=cb)
        got = be._forward(sglang_partial, q, None, None, layer, fb, True, None, {})
    finally:
        gate.set()
        link.close()
    want, _ = merge_local_corpus(o_own.reshape(n, h, -1), lse_own, o_cor, l_cor)
    assert got.shape == o_own.shape
    assert torch.equal(got.reshape(n, h, -1), want)
