"""The capture spool: pages an SGLang server computed, one file per page, in SGLang's layout.

The capture backend (``requester/sglang/hicache.py`` with ``"corpusd_capture": DIR``) runs in the
server; ``corpusd pin --engine`` (:mod:`corpusd.engine.pin`) reads the spool. This module is the
contract between them and imports no sglang, so CPU tests run both sides.

Layout of ``DIR``::

    engine.json             what the server is (:class:`EngineInfo`), written when its host pool
                            is registered
    <page hash>.safetensors one page: "kv" [layers, P, D] in the host pool's dtype (bf16 rows of
                            576, or uint8 rows of 656 for ``--kv-cache-dtype fp8_e4m3``), rope
                            band interleaved as SGLang holds it; "index" uint8 [layers, P·132]
                            (NSA pools: per layer the indexer page, P·128 fp8 e4m3 keys then P
                            float32 scales, ``memory_pool.py: NSATokenToKVPool``)

A page file appears by ``os.replace`` of a finished temp file, so a reader never sees half of one.
Keys are SGLang's chained page hashes (:func:`page_hashes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from corpusd.corpus.manifest import PAGE_SIZE
from corpusd.kernels.formats import D_ROPE, D_V, ROPE_AT, ROW_BYTES

ENGINE_JSON = "engine.json"
ROPE_START, ROPE_WIDTH = D_V, D_ROPE  # V3.2 latent row: c_KV 512 ‖ k_pe 64
INDEX_DIM = 128  # V3.2 index keys; one float32 scale per token (128-wide quant block)
INDEX_TOKEN_BYTES = INDEX_DIM + 4
#: SGLang's kv cache dtypes this pin takes, as the store's (dtype, kv_format)
KV_DTYPES = {"bfloat16": ("bfloat16", "plain"), "fp8_e4m3": ("bfloat16", "fp8_e4m3")}


def page_hash(tokens: Sequence[int], prior: str | None = None) -> str:
    """``sglang.srt.mem_cache.hicache_storage.get_hash_str`` (0.5.10.post1) for plain token ids:
    SHA-256 over the previous page's digest (raw 32 bytes) then each token id as 4 little-endian
    unsigned bytes; the hex digest is the key."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    for t in tokens:
        h.update(int(t).to_bytes(4, byteorder="little", signed=False))
    return h.hexdigest()


def page_hashes(tokens: Sequence[int], page_size: int = PAGE_SIZE) -> list[str]:
    """Chained keys of every whole page of ``tokens`` (from the root of the radix tree)."""
    out: list[str] = []
    prior: str | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = page_hash(tokens[start : start + page_size], prior)
        out.append(prior)
    return out


def deinterleave(band: torch.Tensor) -> torch.Tensor:
    """``[…, d]`` pairs ``(x0, x1), (x2, x3), …`` → ``[x0, x2, … ‖ x1, x3, …]``."""
    return torch.cat([band[..., 0::2], band[..., 1::2]], dim=-1)


def interleave(band: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`deinterleave`."""
    half = band.shape[-1] // 2
    return torch.stack([band[..., :half], band[..., half:]], dim=-1).flatten(-2)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the capture backend reports about its server (``engine.json``).

    ``model_fingerprint`` is ``corpusd.model.checkpoint.fingerprint`` of the directory the server
    loaded, computed in the server; ``kv_dtype`` is ``"bfloat16"`` or ``"fp8_e4m3"`` (the host
    pool's rows: 576 bf16 or 656 bytes); ``index`` whether pages carry NSA indexer pages."""

    model_fingerprint: str
    model_path: str
    page_size: int
    layout: str
    kv_dtype: str
    kv_dim: int
    n_layers: int
    index: bool
    tp_rank: int = 0
    pid: int = 0

    def write(self, spool: Path) -> None:
        _atomic_write(spool / ENGINE_JSON, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def read(cls, spool: Path) -> EngineInfo:
        """Raises OSError (missing, unreadable) or ValueError (not this format)."""
        d: Any = json.loads((spool / ENGINE_JSON).read_text())
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) - names:
            raise ValueError(f"{spool / ENGINE_JSON} is not a corpusd capture engine.json")
        return cls(**d)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def host_page(host: Any, at: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One page of an SGLang host pool (``MLATokenToKVPoolHost`` / ``NSATokenToKVPoolHost``), as
    copies: kv ``[layers, P, D]`` in the pool's dtype and, for NSA pools, the indexer pages uint8
    ``[layers, P·132]`` (else None).

    ``at`` is the page's first host slot (``host_indices[i · page_size]``). The pool's layouts
    (``memory_pool_host.py``): kv ``layer_first [layer, slot, 1, D]``, ``page_first [slot, layer,
    1, D]``, ``page_first_direct [page, layer, P, 1, D]``; indexer ``layer_first``: per layer
    ``[pages, P·132]``, otherwise ``[pages, layer, 1, P·132]``; page number ``at // P``
    (``_get_indexer_page_indices``)."""
    p, kv = host.page_size, host.kv_buffer
    assert at % p == 0, f"host slot {at} does not start a page of {p}"
    if host.layout == "layer_first":
        rows = kv[:, at : at + p, 0, :]
    elif host.layout == "page_first":
        rows = kv[at : at + p, :, 0, :].transpose(0, 1)
    elif host.layout == "page_first_direct":
        rows = kv[at // p, :, :, 0, :]
    else:
        raise ValueError(f"host layout {host.layout!r} is not captured")
    buf = getattr(host, "index_k_with_scale_buffer", None)
    index = None
    if buf is not None:
        page = at // p
        if host.layout == "layer_first":
            index = torch.stack([b[page] for b in buf])
        else:
            index = buf[page, :, 0, :].clone()
    return rows.contiguous().clone(), index


def page_path(spool: Path, key: str) -> Path:
    assert len(key) == 64 and all(c in "0123456789abcdef" for c in key), f"{key=} is no page hash"
    return spool / f"{key}.safetensors"


def write_page(spool: Path, key: str, kv: torch.Tensor, index: torch.Tensor | None) -> None:
    """Store one captured page atomically (a page already there is left as is: same key, same
    tokens, same model)."""
    path = page_path(spool, key)
    if path.exists():
        return
    tensors = {"kv": kv.contiguous()}
    if index is not None:
        tensors["index"] = index.contiguous()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_page(spool: Path, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(kv, index or None) of a captured page. Raises OSError when it is not there."""
    t = load_file(str(page_path(spool, key)))
    return t["kv"], t.get("index")


def capture(host: Any, keys: Sequence[str], host_indices: torch.Tensor, spool: Path) -> list[bool]:
    """``batch_set_v1``'s work in capture mode: page ``i`` of ``keys`` starts at host slot
    ``host_indices[i · page_size]``; each is copied out of ``host`` into ``spool``. True per page
    written (or already there)."""
    out = []
    for i, key in enumerate(keys):
        kv, index = host_page(host, int(host_indices[i * host.page_size]))
        write_page(spool, key, kv, index)
        out.append(True)
    return out


# -- SGLang's page → corpusd's rows ---------------------------------------------------------------
def corpusd_rows(kv: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Captured rows ``[..., D]`` → corpusd's layout (rope band de-interleaved), bit for bit:
    bf16 ``[..., 576]`` stays bf16; fp8 uint8 ``[..., 656]`` keeps its fp8 codes and scales, its
    bf16 rope bytes are permuted. :func:`sglang_rows` inverts it."""
    return _permute_rope(kv, kv_dtype, deinterleave)


def sglang_rows(rows: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Inverse of :func:`corpusd_rows`."""
    return _permute_rope(rows, kv_dtype, interleave)


def _permute_rope(x: torch.Tensor, kv_dtype: str, f: Any) -> torch.Tensor:
    out = x.clone()
    if kv_dtype == "bfloat16":
        assert x.dtype == torch.bfloat16 and x.shape[-1] == ROPE_START + ROPE_WIDTH, f"{x.shape=}"
        out[..., ROPE_START:] = f(x[..., ROPE_START:])
    elif kv_dtype == "fp8_e4m3":
        assert x.dtype == torch.uint8 and x.shape[-1] == ROW_BYTES, f"{x.shape=} {x.dtype=}"
        rope = x[..., ROPE_AT:].contiguous().view(torch.bfloat16)  # k_pe: 64 bf16 at byte 528
        out[..., ROPE_AT:] = f(rope).contiguous().view(torch.uint8)
    else:
        raise ValueError(f"kv dtype {kv_dtype!r}: want one of {sorted(KV_DTYPES)}")
    return out


def index_page_keys(page: torch.Tensor, page_size: int) -> torch.Tensor:
    """One layer's indexer page (uint8 ``[P·132]``) → the keys it stands for, float32 ``[P,
    128]``, in corpusd's convention (unrotated): SGLang stores ``rotate(k)`` quantised, so this
    is ``H · dequantize(page)`` (``H`` is its own inverse). Approximate: the store's float keys
    serve corpusd's own scorers; the exact bytes are kept beside them (``index_pages``)."""
    from indexer import fp8

    q = page[: page_size * INDEX_DIM].view(torch.float8_e4m3fn).view(page_size, INDEX_DIM)
    scale = page[page_size * INDEX_DIM :].contiguous().view(torch.float32).view(page_size)
    return fp8.hadamard(fp8.dequantize(q, scale.unsqueeze(-1), block=INDEX_DIM))


def engine_info(host: Any, model_fingerprint: str, model_path: str, tp_rank: int) -> EngineInfo:
    """What an SGLang host pool holds, for ``engine.json``: its device pool's dtype says the row
    format (the host pool stores fp8 rows as uint8: ``HostKVCache.dtype = store_dtype``)."""
    dev_dtype = host.device_pool.dtype
    kv_dtype = "fp8_e4m3" if dev_dtype == torch.float8_e4m3fn else str(dev_dtype).split(".")[-1]
    return EngineInfo(
        model_fingerprint=model_fingerprint,
        model_path=model_path,
        page_size=int(host.page_size),
        layout=str(host.layout),
        kv_dtype=kv_dtype,
        kv_dim=int(host.kv_cache_dim),
        n_layers=int(host.layer_num),
        index=getattr(host, "index_k_with_scale_buffer", None) is not None,
        tp_rank=tp_rank,
        pid=os.getpid(),
    )
