"""The capture spool without sglang: the capture backend's copy out of a host pool shaped as
SGLang's (every layout, bf16 and fp8 rows), the layout conversion against an explicit index
reference, and the spool → corpus assembly against a direct construction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from corpusd.engine import spool
from corpusd.engine.pin import layer_rows
from requester.sglang.pagehash import host_kv_page, index_k_from_page, index_k_page, page_hashes
from tests.support.sglang_host import FakeNSAHostPool, engine_rows

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KV = ("bfloat16", "fp8_e4m3")
P, LAYERS = 64, 3


def _random_rows(gen: torch.Generator, kv_dtype: str, *shape: int) -> torch.Tensor:
    if kv_dtype == "bfloat16":
        return torch.randn(*shape, 576, generator=gen).to(torch.bfloat16)
    return torch.randint(0, 256, (*shape, 656), generator=gen, dtype=torch.uint8)


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_capture_copies_every_offered_page_out_of_the_host_pool(
    tmp_path: Path, layout: str, kv_dtype: str
) -> None:
    gen = torch.Generator().manual_seed(11)
    host = FakeNSAHostPool(layout, kv_dtype, LAYERS, page_num=9)
    pages = [5, 2, 7]  # host pages out of order, as SGLang's allocator hands them out
    rows = _random_rows(gen, kv_dtype, len(pages), LAYERS, P)
    index = torch.randint(0, 256, (len(pages), LAYERS, P * 132), generator=gen, dtype=torch.uint8)
    for i, page in enumerate(pages):
        for li in range(LAYERS):
            for j in range(P):
                host.put_row(page * P + j, li, rows[i, li, j])
            host.put_index_page(page, li, index[i, li])
    host_indices = torch.cat([torch.arange(pg * P, pg * P + P) for pg in pages])
    keys = page_hashes(torch.randint(0, 1000, (len(pages) * P,), generator=gen).tolist())
    assert spool.capture(host, keys, host_indices, tmp_path) == [True] * 3
    for i, key in enumerate(keys):
        kv, idx = spool.read_page(tmp_path, key)
        assert kv.dtype == host.dtype and torch.equal(kv, rows[i]), f"{layout=} page {i}"
        assert idx is not None and torch.equal(idx, index[i]), f"{layout=} page {i}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k}.safetensors" for k in keys)
    # a page already spooled is kept (same key: same tokens, same model)
    host.kv_buffer.zero_()
    assert spool.capture(host, keys[:1], host_indices[:P], tmp_path) == [True]
    assert torch.equal(spool.read_page(tmp_path, keys[0])[0], rows[0])


def test_rope_band_conversion_matches_an_explicit_index_map() -> None:
    gen = torch.Generator().manual_seed(3)
    bf = _random_rows(gen, "bfloat16", 5)
    # SGLang's band: pairs (x0, x1), (x2, x3), …; corpusd's: evens then odds
    order = [512 + 2 * i for i in range(32)] + [512 + 2 * i + 1 for i in range(32)]
    want = torch.cat([bf[:, :512], bf[:, order]], dim=1)
    assert torch.equal(spool.corpusd_rows(bf, "bfloat16"), want)
    assert torch.equal(spool.sglang_rows(want, "bfloat16"), bf)
    raw = _random_rows(gen, "fp8_e4m3", 5)
    got = spool.corpusd_rows(raw, "fp8_e4m3")
    assert torch.equal(got[:, :528], raw[:, :528]), "fp8 codes and scales are not permuted"
    rope = raw[:, 528:].contiguous().view(torch.bfloat16)
    want_rope = rope[:, [2 * i for i in range(32)] + [2 * i + 1 for i in range(32)]]
    assert torch.equal(got[:, 528:].contiguous().view(torch.bfloat16), want_rope)
    assert torch.equal(spool.sglang_rows(got, "fp8_e4m3"), raw)


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fetch_then_capture_is_the_identity(tmp_path: Path, layout: str, kv_dtype: str) -> None:
    """A stored page served into a host pool by the fetch path and captured back converts to the
    stored rows bit for bit: the two directions agree on SGLang's layout."""
    gen = torch.Generator().manual_seed(5)
    if kv_dtype == "bfloat16":
        stored = torch.randn(LAYERS, P, 576, generator=gen).to(torch.bfloat16)
    else:
        stored = _random_rows(gen, "fp8_e4m3", LAYERS, P)
    host = FakeNSAHostPool(layout, kv_dtype, LAYERS, page_num=4)
    host.set_from_flat_data_page(3 * P, host_kv_page(stored, layout, host.dtype))
    kv, _ = spool.host_page(host, 3 * P)
    assert torch.equal(spool.corpusd_rows(kv, kv_dtype), stored)


@pytest.mark.parametrize("kv_dtype", KV)
def test_layer_rows_assemble_the_corpus_an_engine_computed(kv_dtype: str) -> None:
    """Spooled pages (built here the way the engine holds corpusd-layout rows) → per layer the
    stored latent rows bit for bit, the indexer pages verbatim with the tail zeroed, and float
    keys within fp8 rounding of the originals."""
    gen = torch.Generator().manual_seed(9)
    n_tok = 2 * P + 17  # a partial last page: its rows past n_tok are the filler's
    latent = torch.randn(LAYERS, 3 * P, 576, generator=gen)
    keys = torch.randn(LAYERS, 3 * P, 128, generator=gen)
    pages = []
    for pg in range(3):
        sl = slice(pg * P, pg * P + P)
        kv = engine_rows(latent[:, sl], kv_dtype)
        idx = torch.stack([index_k_page(keys[li, sl]) for li in range(LAYERS)])
        pages.append((kv, idx))
    for li in range(LAYERS):
        rows, keys_f, index_pages = layer_rows(pages, li, n_tok, P, kv_dtype)
        want = latent[li, :n_tok].to(torch.bfloat16)
        if kv_dtype == "fp8_e4m3":
            from corpusd.kernels import fp8_cache

            want = fp8_cache.quantize(want)
        assert torch.equal(rows, want), f"layer {li}"
        assert torch.equal(index_pages[:2], torch.stack([p[1][li] for p in pages[:2]]))
        last, tail = index_pages[2], n_tok - 2 * P
        full = pages[2][1][li]
        assert torch.equal(last[: tail * 128], full[: tail * 128])
        assert not last[tail * 128 : P * 128].any() and not last[P * 128 + tail * 4 :].any()
        assert torch.equal(last[P * 128 : P * 128 + tail * 4], full[P * 128 : P * 128 + tail * 4])
        # float keys: the engine's dequantised keys rotated back; fp8 e4m3 keeps 3 mantissa bits
        err = (keys_f - keys[li, :n_tok]).norm(dim=-1) / keys[li, :n_tok].norm(dim=-1)
        assert float(err.max()) < 0.08, f"layer {li}: {float(err.max())=}"
        # and what the route path's scorer sees of them equals the engine's keys' values
        deq = index_k_from_page(full)
        assert torch.allclose(spool.index_page_keys(full, P), deq @ _h(), atol=1e-5)


def _h() -> torch.Tensor:
    from indexer.fp8 import hadamard

    return hadamard(torch.eye(128))


def test_engine_info_reports_what_the_pool_holds(tmp_path: Path) -> None:
    host = FakeNSAHostPool("page_first", "fp8_e4m3", LAYERS, page_num=2)
    info = spool.engine_info(host, "sha256:abc", "/m", 0)
    assert (info.kv_dtype, info.kv_dim, info.n_layers, info.page_size, info.index) == (
        "fp8_e4m3", 656, LAYERS, P, True,
    )  # fmt: skip
    info.write(tmp_path)
    assert spool.EngineInfo.read(tmp_path) == info
    (tmp_path / spool.ENGINE_JSON).write_text('{"model": 1}')
    with pytest.raises(ValueError, match=r"not a corpusd capture engine\.json"):
        spool.EngineInfo.read(tmp_path)
