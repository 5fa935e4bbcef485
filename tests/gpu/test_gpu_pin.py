"""``corpusd pin --device cuda``: the GPU prefill in bf16 stores what the CPU's does, within bf16.

The CPU fp32 pin of the same corpus is the reference: every layer's latent rows and index keys
of the GPU pin are compared with a relative tolerance that bf16 weights and activations allow,
and the corpus id differs only through the cache dtype. Both prefill kernel sets run: ``auto``
(Triton index scores + FlashMLA or Triton per call on SM90) and the torch references. The
Triton scorer is also held to ``index_scores`` at the SGLang preset's shape. GPU only
(``-m gpu``); skips elsewhere.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from corpusd.corpus.pin import PinConfig, pin
from corpusd.corpus.store import PageStore
from corpusd.testing.numeric import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("chunk,kernels", [(256, "auto"), (1024, "auto"), (1024, "torch")])
def test_gpu_pin_pages_match_the_cpu_pin(
    tmp_path: Path, tiny_dir: Path, chunk: int, kernels: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    root = Path(__file__).resolve().parents[2]
    for name in ("config.py", "layout.py"):  # ~3k byte tokens: past index_topk many times
        (src / name).write_bytes((root / "corpusd" / "corpus" / name).read_bytes())
    store = PageStore(tmp_path / "store")
    ref = pin(PinConfig(corpus=str(src), model=str(tiny_dir), store=str(store.root)), io.StringIO())
    out = io.StringIO()
    gpu = pin(
        PinConfig(
            corpus=str(src), model=str(tiny_dir), store=str(store.root), chunk=chunk,
            dtype="bfloat16", device="cuda:0", kernels=kernels,
        ),
        out,
    )  # fmt: skip
    a, b = ref.manifest, gpu.manifest
    assert "on cuda:0" in out.getvalue() and "prefill |" in out.getvalue()
    if kernels == "torch":
        assert "kernels: torch index scores, torch sparse attention" in out.getvalue()
    elif torch.cuda.get_device_capability()[0] == 9:
        # the registry's choice (corpusd.kernels.registry.choose), as a holder's: per call
        assert "kernels: Triton index scores, flashmla|triton sparse attention (" in out.getvalue()
    assert a.token_count == b.token_count and a.token_count > 8 * 128
    assert a.corpus_id != b.corpus_id and b.dtype == "bfloat16"
    pages = list(range(a.n_pages))
    for layer in range(a.n_layers):
        lat_a, idx_a = store.read_pages(a.corpus_id, layer, pages)
        lat_b, idx_b = store.read_pages(b.corpus_id, layer, pages)
        assert rel(lat_b.float(), lat_a.float()) <= 3e-2, f"{layer=} latent"
        assert rel(idx_b.float(), idx_a.float()) <= 3e-2, f"{layer=} index keys"


@pytest.mark.parametrize("arith", ["exact", "fp8"])
def test_triton_index_scores_match_the_reference(arith: str) -> None:
    from indexer import index_scores
    from indexer.triton_scores import triton_index_scores

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(300, 64, 128, generator=g, device="cuda").bfloat16()
    keys = torch.randn(5000, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(300, 64, generator=g, device="cuda") / 8
    limit = torch.arange(4700, 5000, device="cuda") + 1  # a causal prefill chunk's rows
    ref = index_scores(q, w, keys, 128**-0.5, arith, limit)
    got = triton_index_scores(q, w, keys, 128**-0.5, arith, limit=limit)
    masked = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), masked) and int(masked.sum()) == 300 * 299 // 2
    diff = (got - ref).masked_fill(masked, 0.0).abs().max()
    # exact: bf16 operands, float32 sums (only the order differs). fp8: the e4m3 products are
    # exact, but Hopper's fp8 MMA keeps ~14 bits while summing a block's 128 of them (SGLang's
    # kernel does the same); a wrong scale would be off by O(1)
    err = float(diff / ref.masked_fill(masked, 0.0).abs().max())
    assert err < {"exact": 1e-5, "fp8": 2e-3}[arith], f"{arith}: {err=}"
