"""A stand-in for SGLang's NSA host pool (no sglang needed), shaped as sglang 0.5.10.post1's
``mem_cache/memory_pool_host.py`` allocates it, and a stand-in "engine" that fills it.

``NSATokenToKVPoolHost`` (a ``MLATokenToKVPoolHost``): ``dtype = device_pool.store_dtype`` (uint8
for an fp8 device pool), ``kv_cache_dim`` 576 (bf16) or 656 (fp8), ``kv_buffer`` per
``init_kv_buffer``: ``layer_first [layer_num, size, 1, D]``, ``page_first [size, layer_num, 1,
D]``, ``page_first_direct [page_num, layer_num, page_size, 1, D]``; the indexer buffer per
``_init_indexer_buffers``: ``layer_first`` a list of ``[indexer_page_num, P·132]`` uint8,
otherwise ``[indexer_page_num, layer_num, 1, P·132]``. ``set_from_flat_data_page`` is a
transcription of SGLang's (the fetch path writes pages through it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from corpusd.kernels import fp8_cache
from requester.sglang.pagehash import index_k_page
from requester.sglang.positions import to_sglang_layout

INDEX_PAGE = 64 * 132


class FakeNSAHostPool:
    def __init__(
        self, layout: str, kv_dtype: str, layer_num: int, page_num: int, page_size: int = 64
    ) -> None:
        self.layout, self.page_size, self.layer_num = layout, page_size, layer_num
        fp8 = kv_dtype == "fp8_e4m3"
        self.dtype = torch.uint8 if fp8 else torch.bfloat16
        self.device_pool = SimpleNamespace(dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        self.kv_cache_dim = 656 if fp8 else 576
        self.page_num, self.size = page_num, page_num * page_size
        d, p, n = self.kv_cache_dim, page_size, self.size
        shape = {
            "layer_first": (layer_num, n, 1, d),
            "page_first": (n, layer_num, 1, d),
            "page_first_direct": (page_num, layer_num, p, 1, d),
        }[layout]
        self.kv_buffer = torch.zeros(shape, dtype=self.dtype)
        stride = p * 132
        index_pages = (self.size + p + 1) // p  # SGLang's indexer_page_num
        if layout == "layer_first":
            self.index_k_with_scale_buffer: list[torch.Tensor] | torch.Tensor = [
                torch.zeros(index_pages, stride, dtype=torch.uint8) for _ in range(layer_num)
            ]
        else:
            self.index_k_with_scale_buffer = torch.zeros(
                index_pages, layer_num, 1, stride, dtype=torch.uint8
            )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        p, lay, d = self.page_size, self.layer_num, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + p] = data_page.reshape(lay, p, 1, d)
        elif self.layout == "page_first":
            self.kv_buffer[index : index + p] = data_page.reshape(p, lay, 1, d)
        else:
            self.kv_buffer[index // p : index // p + 1] = data_page.reshape(1, lay, p, 1, d)

    def put_row(self, slot: int, layer: int, row: torch.Tensor) -> None:
        """One token's row, element by element of SGLang's indexing (the tests' reference)."""
        if self.layout == "layer_first":
            self.kv_buffer[layer, slot, 0] = row
        elif self.layout == "page_first":
            self.kv_buffer[slot, layer, 0] = row
        else:
            self.kv_buffer[slot // self.page_size, layer, slot % self.page_size, 0] = row

    def put_index_page(self, page: int, layer: int, data: torch.Tensor) -> None:
        buf = self.index_k_with_scale_buffer
        if isinstance(buf, list):
            buf[layer][page] = data
        else:
            buf[page, layer, 0] = data


def engine_rows(latent: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """corpusd's latent rows ``[..., 576]`` (float) → the rows an SGLang pool of ``kv_dtype``
    holds for them: bf16 with the rope band interleaved, or fp8 656-byte rows (band interleaved
    in their bf16 rope part)."""
    if kv_dtype == "bfloat16":
        return to_sglang_layout(latent.to(torch.bfloat16))
    flat = latent.reshape(-1, latent.shape[-1])
    rows = fp8_cache.quantize(to_sglang_layout(flat.to(torch.bfloat16)))
    return rows.reshape(*latent.shape[:-1], 656)


def fill_page(
    host: FakeNSAHostPool,
    page: int,
    latent: torch.Tensor,
    keys: torch.Tensor,
    kv_dtype: str,
) -> None:
    """Write one corpus page into host page ``page`` as the engine would hold it: ``latent``
    ``[layers, P, 576]`` and index keys ``[layers, P, 128]`` (corpusd's layout, float)."""
    rows = engine_rows(latent, kv_dtype)
    for li in range(host.layer_num):
        for j in range(host.page_size):
            host.put_row(page * host.page_size + j, li, rows[li, j])
        host.put_index_page(page, li, index_k_page(keys[li]))


def load_hicache(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``requester/sglang/hicache.py`` under a private name. Without sglang (CPU CI), its one
    sglang import, the ``HiCacheStorage`` base class, is an empty stand-in: the methods under test
    are all the backend's own."""
    if importlib.util.find_spec("sglang") is None:
        base = ModuleType("sglang.srt.mem_cache.hicache_storage")
        base.HiCacheStorage = type("HiCacheStorage", (), {})  # type: ignore[attr-defined]
        for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
            monkeypatch.setitem(sys.modules, name, ModuleType(name))
        monkeypatch.setitem(sys.modules, base.__name__, base)
    path = Path(__file__).resolve().parents[2] / "requester" / "sglang" / "hicache.py"
    spec = importlib.util.spec_from_file_location("_corpusd_hicache_under_test", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_backend(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``requester/sglang/backend.py`` under a private name. Without sglang (CPU CI), its sglang
    imports are stand-ins: an empty ``NativeSparseAttnBackend``, ``NSAIndexerMetadata`` as a
    frozen dataclass, and tensor parallelism of one (``dp_attention``). What a test calls is the
    plugin's own code (``_forward`` takes SGLang's attention as an argument)."""
    import dataclasses

    if importlib.util.find_spec("sglang") is None:
        nsa = ModuleType("sglang.srt.layers.attention.nsa_backend")
        nsa.NativeSparseAttnBackend = type("NativeSparseAttnBackend", (), {})  # type: ignore[attr-defined]
        nsa.NSAIndexerMetadata = dataclasses.dataclass(frozen=True)(  # type: ignore[attr-defined]
            type("NSAIndexerMetadata", (), {})
        )
        dp = ModuleType("sglang.srt.layers.dp_attention")
        dp.get_attention_tp_size = lambda: 1  # type: ignore[attr-defined]
        dp.get_attention_tp_rank = lambda: 0  # type: ignore[attr-defined]
        pkgs = ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention")
        for name in pkgs:
            monkeypatch.setitem(sys.modules, name, ModuleType(name))
        monkeypatch.setitem(sys.modules, nsa.__name__, nsa)
        monkeypatch.setitem(sys.modules, dp.__name__, dp)
    path = Path(__file__).resolve().parents[2] / "requester" / "sglang" / "backend.py"
    spec = importlib.util.spec_from_file_location("_corpusd_backend_under_test", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses resolve names there
    spec.loader.exec_module(mod)
    return mod
