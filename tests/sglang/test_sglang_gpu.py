"""The SGLang glue on a GPU with sglang 0.5.10.post1 installed (``pytest -m sglang``).

Skipped elsewhere with the reason. They passed on one H200 (sglang 0.5.10.post1 from
.sglang-deps/). The end-to-end check (a tiny DeepSeek-V3.2 served by a live SGLang server stock,
through this plugin and through the HiCache backend, outputs compared) is
``tests/test_sglang_server.py``, which runs ``tools/bench_sglang.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel
from requester.sglang import lse as lse_mod
from tests.support.checks import why_no_sglang_gpu

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(bool(why_no_sglang_gpu()), reason=why_no_sglang_gpu()),
]


def test_package_registers_entry_class_and_nsa_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.registry import ModelRegistry

    ModelRegistry.register("requester.sglang", overwrite=True, strict=True)
    from requester.sglang import deepseek_v32
    from requester.sglang.backend import create_corpus_nsa_backend

    cls, arch = ModelRegistry.resolve_model_cls(["DeepseekV32ForCausalLM"])
    assert cls is deepseek_v32.DeepseekV32ForCausalLM and arch == "DeepseekV32ForCausalLM"
    assert ATTENTION_BACKENDS["nsa"] is create_corpus_nsa_backend


def test_local_partial_keeps_flashmla_lse() -> None:
    from requester.sglang.backend import CorpusNSABackend

    be = CorpusNSABackend.__new__(CorpusNSABackend)  # the kernel call only needs the SM
    be.device_sm_major = 9
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, rows, k = 6, 64, 1024, 128
    q = torch.randn(n, h, 576, generator=g, device="cuda").bfloat16()
    kv = torch.randn(rows, 1, 576, generator=g, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(rows, generator=g, device="cuda")[:k] for _ in range(n)])
    idx[1, 64:] = -1
    idx[2] = -1  # nothing selected: O = 0, LSE = -inf
    o = be._forward_flashmla_sparse(q, kv, 512, idx.int(), 576**-0.5)
    want_o, want_l = partial_attention(q.float(), kv[:, 0].float(), idx, 576**-0.5, 512)
    assert rel(o.float(), want_o) < 2e-2, f"{rel(o.float(), want_o)=}"
    assert be._lse is not None and bool(torch.isinf(be._lse[2]).all()) and bool((o[2] == 0).all())
    fin = ~torch.isinf(want_l)
    assert torch.allclose(be._lse[fin], want_l[fin], atol=2e-2), (be._lse[0, :4], want_l[0, :4])


def test_sglang_merge_state_on_our_conventions_equals_our_merge() -> None:
    from sglang.srt.layers.attention.merge_state import merge_state

    g = torch.Generator(device="cuda").manual_seed(1)
    n, h = 8, 16
    oa = torch.randn(n, h, 512, generator=g, device="cuda")
    ob = torch.randn(n, h, 512, generator=g, device="cuda")
    la = torch.randn(n, h, generator=g, device="cuda")
    lb = torch.randn(n, h, generator=g, device="cuda")
    la[0], lb[1] = -math.inf, -math.inf
    la[2] = lb[2] = -math.inf
    oa[0], ob[1], oa[2], ob[2] = 0, 0, 0, 0
    o, l_m = merge_state(oa, lse_mod.to_merge_state(la), ob, lse_mod.to_merge_state(lb))
    o, l_m = lse_mod.repair_empty(
        o, lse_mod.from_merge_state(l_m), torch.isinf(la) & torch.isinf(lb)
    )
    want_o, want_l = lse_mod.merge_local_corpus(oa, la, ob, lb)
    assert rel(o, want_o) < 1e-5 and torch.equal(torch.isinf(l_m), torch.isinf(want_l))


def test_fp8_indexer_arithmetic_is_sglangs() -> None:
    """indexer/fp8.py and the corpus's index-key pages against SGLang's own kernels: its
    Hadamard rotation, act_quant (queries, ue8m0) and the index-key store (keys)."""
    from sglang.jit_kernel.fused_store_index_cache import (
        can_use_nsa_fused_store,
        fused_store_index_k_cache,
    )
    from sglang.srt.layers.attention.nsa.nsa_indexer import rotate_activation
    from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

    from indexer import fp8
    from requester.sglang.pagehash import index_k_page, sglang_key_scales_ue8m0

    g = torch.Generator(device="cuda").manual_seed(0)
    spread = torch.logspace(-3, 2, 256, device="cuda")[:, None]
    x = (torch.randn(256, 128, generator=g, device="cuda") * spread).bfloat16()
    rot = rotate_activation(x)
    same_rot = float((rot.cpu() == fp8.rotate_round(x.cpu())).float().mean())
    assert same_rot >= 0.999, f"rotation: {same_rot:.5f} of bf16 values equal"

    # queries: act_quant at ue8m0, from the same rotated values: bitwise
    qv, qs = act_quant(rot.contiguous(), 128, "ue8m0")
    mv, ms = fp8.quantize(rot.cpu(), ue8m0=True)
    assert torch.equal(qs.cpu().view(-1), ms.view(-1))
    assert torch.equal(qv.cpu().view(torch.uint8), mv.view(torch.uint8))

    # keys: what this server stores, page bytes
    fused = can_use_nsa_fused_store(torch.bfloat16, torch.int64, 64)
    assert sglang_key_scales_ue8m0(64) == (not fused)
    buf = torch.zeros(4, 64 * 132, dtype=torch.uint8, device="cuda")
    if fused:
        loc = torch.arange(256, device="cuda", dtype=torch.int64)
        fused_store_index_k_cache(rot.contiguous(), buf, loc, 64)
    else:
        kv, ks = act_quant(rot.contiguous(), 128, "ue8m0")
        for p in range(4):
            rows = slice(64 * p, 64 * (p + 1))
            buf[p] = torch.cat(
                [kv[rows].view(torch.uint8).flatten(), ks[rows].view(torch.uint8).flatten()]
            )
    theirs = buf.cpu()
    ue8m0 = not fused
    mine = torch.stack([index_k_page(x[64 * p : 64 * (p + 1)].cpu(), ue8m0) for p in range(4)])
    exact = torch.stack(
        [
            torch.cat([v.view(torch.uint8).flatten(), s.view(torch.uint8).flatten()])
            for v, s in (fp8.quantize(rot[64 * p : 64 * (p + 1)].cpu(), ue8m0) for p in range(4))
        ]
    )
    assert torch.equal(exact, theirs), "same rotated keys, different page bytes"
    same_page = float((mine == theirs).float().mean())
    assert same_page >= 0.999, f"index_k_page: {same_page:.5f} of bytes equal (fused={fused})"


def test_fetch_partial_over_the_page_cache_is_the_reference() -> None:
    """Fetch's local partial as the plugin runs it on the GPU: pages filled into the bf16 page
    cache, FlashMLA's sparse kernel over the plan's rows (padded to whole top-k blocks), against
    the torch reference over the source rows (the CPU tests check the same rows on CPU)."""
    from corpusd.kernels.flashmla import sparse_lse_base2
    from corpusd.kernels.formats import TOPK_ALIGN
    from requester.sglang.device import sparse_partial
    from requester.sglang.host_path import pad_cols
    from requester.sglang.page_cache import PageCache

    g = torch.Generator().manual_seed(1)
    src = torch.randn(20, 64, 576, generator=g).bfloat16()  # a corpus of 20 pages, as pinned
    cache = PageCache(1, 64, 576, 12 * 64 * 576 * 2, torch.bfloat16, torch.device("cuda"))
    q = torch.randn(5, 64, 576, generator=g).bfloat16().cuda()
    base2 = sparse_lse_base2("cuda:0")
    for step in range(4):  # evictions and hits between steps
        cache.new_step()
        pages = torch.randperm(20, generator=g)[:10]
        pos = pages[torch.randint(0, 10, (5, 300), generator=g)] * 64
        pos = pos + torch.randint(0, 64, (5, 300), generator=g)
        pos[1, 100:] = -1
        pos[2] = -1  # nothing selected
        plan = cache.plan(0, "c", pos)
        if plan.fill_pages:
            cache.fill(0, plan.fill_slots, src[plan.fill_pages])
        rows = pad_cols(plan.rows, TOPK_ALIGN).cuda()
        o, lse = sparse_partial(q, cache.kv(0), rows, 576**-0.5, 512, base2)
        want_o, want_l = partial_attention(
            q.float().cpu(), src.reshape(-1, 576).float(), pos, 576**-0.5, 512
        )
        assert rel(o.cpu(), want_o) < 2e-2, f"{step=}: {rel(o.cpu(), want_o)=}"
        fin = ~torch.isinf(want_l)
        assert torch.equal(torch.isinf(lse.cpu()), ~fin), step
        assert torch.allclose(lse.cpu()[fin], want_l[fin], atol=2e-2), step
        assert not bool(o.isnan().any()), f"{step=}: a NaN-poisoned (unfilled) row was read"
