"""SGLang's page hashes and host page layout, so a pinned corpus can feed HiCache.

:func:`page_hash` is ``sglang.srt.mem_cache.hicache_storage.get_hash_str`` (0.5.10.post1) for
plain token ids: SHA-256 over the previous page's digest (raw 32 bytes) then each token id as 4
little-endian unsigned bytes; the hex digest is the key. ``HiCacheController._storage_hit_query``
(``managers/cache_controller.py``) chains it over ``page_size`` tokens per page from the root,
and the radix cache (``mem_cache/radix_cache.py: compute_node_hash_values``) does the same, so
page ``p`` of a prompt that starts with the corpus has key ``page_hashes(corpus)[p]``. Only
whole pages have keys; the corpus's last partial page is recomputed by SGLang.
"""

from __future__ import annotations

import torch

from corpusd.corpus.manifest import PAGE_SIZE
from corpusd.engine.spool import page_hash, page_hashes, sglang_rows
from indexer import fp8
from requester.sglang.positions import INDEX_DIM, to_sglang_layout

__all__ = ["page_hash", "page_hashes"]  # SGLang's keys, defined beside the capture spool


def host_kv_page(latent: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """One page of corpusd's latent cache as ``MLATokenToKVPoolHost.get_data_page(flat=True)``
    holds it: bf16 (or float32) rows into a bf16 pool, or fp8 656-byte rows into an fp8 pool.

    Args:
        latent: ``[layers, page_size, 576]`` (``c_KV ‖ k_pe``, k_pe de-interleaved as corpusd
            stores it), or uint8 ``[layers, page_size, 656]`` fp8 rows.
        layout: the host pool's ``--hicache-mem-layout``: ``layer_first`` (``[layer, token, 1,
            576]``) or ``page_first`` / ``page_first_direct`` (``[token, layer, 1, 576]`` and
            ``[1, layer, token, 1, 576]``).
        dtype: the pool's dtype (``mem_pool_host.dtype``).

    Returns:
        flat ``[layers · page_size · 576]`` in ``dtype``, rope band interleaved.
    """
    if latent.dtype == torch.uint8:  # fp8 rows (656 bytes): only an fp8 pool takes them
        if dtype != torch.uint8:
            raise ValueError(f"fp8 pages go into an fp8 (uint8) host pool, not {dtype}")
        rows = sglang_rows(latent, "fp8_e4m3")
    else:
        rows = to_sglang_layout(latent).to(dtype)
    if layout in ("layer_first", "page_first_direct"):
        return rows.contiguous().flatten()
    if layout == "page_first":
        return rows.transpose(0, 1).contiguous().flatten()
    raise ValueError(f"host layout {layout!r}: want layer_first, page_first or page_first_direct")


def sglang_key_scales_ue8m0(page_size: int, scale_fmt: str | None = "ue8m0") -> bool:
    """Whether this SGLang stores index keys with power-of-two scales. On CUDA it stores them
    with its fused JIT kernel (plain fp32 scales) when that loads, else through ``act_quant`` at
    the indexer's ``scale_fmt`` (``"ue8m0"`` for DeepSeek-V3.2): ``nsa_indexer.py:
    _store_index_k_cache``. Imports sglang: call it in an SGLang process."""
    from sglang.jit_kernel.fused_store_index_cache import can_use_nsa_fused_store

    if can_use_nsa_fused_store(torch.bfloat16, torch.int64, page_size):
        return False
    return scale_fmt == "ue8m0"


def index_k_page(keys: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """One page of index keys ``[page_size, 128]`` as an NSA ``index_k_with_scale_buffer`` page:
    uint8 ``[page_size·128 + page_size·4]`` = the fp8 e4m3 keys, then one float32 scale per token
    (``memory_pool.py: NSATokenToKVPool``: "buf[i, :page_size * head_dim] for fp8 data,
    buf[i, page_size * head_dim:].view(float32) for scale"; 128-wide quant block = one scale per
    token). What SGLang stores is the key after its Hadamard rotation (``rotate_activation``), in
    bf16, quantised with plain fp32 scales, or power-of-two ones under ``ue8m0`` (see
    :func:`sglang_key_scales_ue8m0`); :mod:`indexer.fp8` does the same."""
    q, scale = fp8.quantize(fp8.rotate_round(keys), ue8m0)
    return torch.cat([q.view(torch.uint8).flatten(), scale.flatten().view(torch.uint8)])


def index_k_from_page(
    page: torch.Tensor, page_size: int = PAGE_SIZE, dim: int = INDEX_DIM
) -> torch.Tensor:
    """The keys of an :func:`index_k_page` page as SGLang's indexer scores them: rotated and
    dequantised, float32 ``[page_size, dim]``."""
    q = page[: page_size * dim].view(torch.float8_e4m3fn).view(page_size, dim)
    scale = page[page_size * dim :].contiguous().view(torch.float32).view(page_size, 1)
    return fp8.dequantize(q, scale, block=dim)
