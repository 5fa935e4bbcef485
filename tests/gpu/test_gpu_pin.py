"""``corpusd pin --device cuda``: the GPU prefill in bf16 stores what the CPU's does, within bf16.

The CPU fp32 pin of the same corpus is the reference: every layer's latent rows and index keys
of the GPU pin are compared with a relative tolerance that bf16 weights and activations allow,
and the corpus id differs only through the cache dtype. GPU only (``-m gpu``); skips elsewhere.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from corpusd.corpus.pin import PinConfig, pin
from corpusd.corpus.store import PageStore
from tests.support.checks import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("chunk", [256, 1024])
def test_gpu_pin_pages_match_the_cpu_pin(tmp_path: Path, tiny_dir: Path, chunk: int) -> None:
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
            dtype="bfloat16", device="cuda:0",
        ),
        out,
    )  # fmt: skip
    a, b = ref.manifest, gpu.manifest
    assert "on cuda:0" in out.getvalue() and "prefill |" in out.getvalue()
    assert a.token_count == b.token_count and a.token_count > 8 * 128
    assert a.corpus_id != b.corpus_id and b.dtype == "bfloat16"
    pages = list(range(a.n_pages))
    for layer in range(a.n_layers):
        lat_a, idx_a = store.read_pages(a.corpus_id, layer, pages)
        lat_b, idx_b = store.read_pages(b.corpus_id, layer, pages)
        assert rel(lat_b.float(), lat_a.float()) <= 3e-2, f"{layer=} latent"
        assert rel(idx_b.float(), idx_a.float()) <= 3e-2, f"{layer=} index keys"
