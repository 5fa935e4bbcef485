"""Fetch integration: a HiCache storage backend that serves pinned corpora's pages to SGLang.

Imports sglang; SGLang loads it with ``--enable-hierarchical-cache --hicache-storage-backend
dynamic --hicache-storage-backend-extra-config '{"backend_name": "corpusd", "module_path":
"requester.sglang.hicache", "class_name": "CorpusdHiCacheStorage", "interface_v1": 1,
"corpusd_store": "/path/to/store"}'`` (``mem_cache/storage/backend_factory.py:
_create_dynamic_backend`` calls ``cls(storage_config, kwargs)``; ``interface_v1`` selects the
zero-copy ``batch_get_v1(keys, host_indices)`` path in ``managers/cache_controller.py``).

Here the corpus *is* in the request's prompt (canonical positions 0..T−1, a stock DeepSeek-V3.2
request); the backend only saves SGLang from prefilling it. Keys are SGLang's chained page
hashes (:func:`..pagehash.page_hashes`) of every whole page of every ready corpus in the store
pinned for this model. A page is written into the host pool in SGLang's layout: latent rows
with the rope band interleaved (bf16 KV cache only), and — for ``NSATokenToKVPoolHost`` — the
indexer page (fp8 keys + per-token scales) into ``index_k_with_scale_buffer``.

Read-only: a set never writes. SGLang offers every page it computed back to storage and counts a
False as a failed write ("Write page to storage: N pages failed", ``cache_controller.
_page_backup``). A key is the chained hash of its page's tokens and all tokens before them, so a
key we serve names a page the corpus already holds, for the same tokens and model: that set
succeeds with nothing to do, as ``HiCacheFile.set`` does for a key it has. Any other key's set
fails; SGLang's own pages stay in SGLang.

Capture mode (``"corpusd_capture": "/spool/dir"`` instead of ``"corpusd_store"``, with
``--hicache-write-policy write_through``): the backend serves nothing (``batch_exists`` is 0, so
SGLang computes every page) and every page SGLang backs up is copied out of the host pool into
the spool (:func:`corpusd.engine.spool.capture`), for ``corpusd pin --engine`` to store. With TP >
1 every rank holds the same MLA latent and indexer pages; rank 0 writes them, the others answer
True. ``engine.json`` (what the pool holds, the model's fingerprint) is written when SGLang
registers the host pool.

Every method SGLang calls from its storage threads answers instead of raising: ``batch_exists``
runs in the prefetch thread, ``batch_get_v1`` in its I/O helper and ``batch_set_v1`` in the backup
thread (``managers/cache_controller.py``), and those loops catch nothing but ``queue.Empty``. An
exception ends the thread for the life of the server: with the ``wait_complete`` prefetch policy
every later request that asks storage waits forever, and with a dead backup thread no backup is
acknowledged again (``ongoing_backup`` never drains, so ``/flush_cache`` is refused from then on and
nothing more reaches the spool). A failure is logged and answered as a miss (get) or a failed write
(set), which SGLang handles.

Written against sglang 0.5.10.post1; ran in a live server (``tools/bench_sglang.py``, fetch mode).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from corpusd.engine import spool
from corpusd.model.checkpoint import fingerprint
from requester.sglang.pagehash import sglang_key_scales_ue8m0
from requester.sglang.pages import CorpusPages

log = logging.getLogger("corpusd.sglang")


class CorpusdHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if ("corpusd_store" in extra) == ("corpusd_capture" in extra):
            raise ValueError(
                'corpusd HiCache backend: set one of "corpusd_store" (serve pinned pages) or '
                '"corpusd_capture" (a spool directory for corpusd pin --engine) in '
                "--hicache-storage-backend-extra-config"
            )
        # HiCacheStorageConfig.model_name is --served-model-name, which defaults to the model
        # path; "model_path" in the extra config covers a server that renames its model.
        self.model_path = str(extra.get("model_path") or storage_config.model_name)
        model_fp = extra.get("model_fingerprint") or fingerprint(self.model_path)
        self.model_fp = model_fp
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self._key_ue8m0: bool | None = None  # how this server scales index keys (first read)
        self.spool: Path | None = None
        if "corpusd_capture" in extra:
            self.spool = Path(extra["corpusd_capture"])
            self.spool.mkdir(parents=True, exist_ok=True)
            self.corpus_pages = CorpusPages.empty()
            log.info("corpusd HiCache backend: capturing pages into %s", self.spool)
            return
        self.corpus_pages = CorpusPages(extra["corpusd_store"], model_fp)
        log.info(
            "corpusd HiCache backend: %d pages of pinned corpora", len(self.corpus_pages.pages)
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host  # what HiCacheStorage's own does
        if self.spool is not None and self.tp_rank == 0:
            info = spool.engine_info(mem_pool_host, self.model_fp, self.model_path, self.tp_rank)
            info.write(self.spool)

    def exists(self, key: str) -> bool:
        return key in self.corpus_pages

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self.corpus_pages.prefix_hits(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Per key, whether its page is now in the host pool. SGLang uses the leading Trues
        (``_page_get_zero_copy``); a page that cannot be read (its corpus removed since the index
        was built, say) is a miss, and so is every page after it (module docstring)."""
        out = [False] * len(keys)
        for i, key in enumerate(keys):
            if key not in self.corpus_pages:
                break
            try:
                self._get_page(key, int(host_indices[i * self.mem_pool_host.page_size]))
            except Exception:
                log.exception("corpusd HiCache backend: page %s… not served", key[:16])
                break
            out[i] = True
        return out

    def _get_page(self, key: str, at: int) -> None:
        """Write the page ``key`` names into the host pool at slot ``at`` (its first slot)."""
        host = self.mem_pool_host
        index_buf = getattr(host, "index_k_with_scale_buffer", None)  # NSA host pools only
        if self._key_ue8m0 is None:
            self._key_ue8m0 = sglang_key_scales_ue8m0(host.page_size)
        kv, index_pages = self.corpus_pages.host_page(key, host.layout, host.dtype, self._key_ue8m0)
        host.set_from_flat_data_page(at, kv)
        if index_buf is not None:
            page = at // host.page_size  # NSATokenToKVPoolHost._get_indexer_page_indices
            for li, data in enumerate(index_pages):
                if host.layout == "layer_first":
                    index_buf[li][page] = data
                else:
                    index_buf[page, li, 0] = data

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Capture mode: copy each page into the spool (True). Fetch mode: per key, whether the
        page is stored (held already); writes nothing (module docstring)."""
        if self.spool is not None:
            if self.tp_rank != 0:
                return [True] * len(keys)
            try:
                return spool.capture(self.mem_pool_host, keys, host_indices, self.spool)
            except Exception:  # a full disk, say: SGLang logs the failed write and goes on
                log.exception(
                    "corpusd HiCache backend: %d pages not captured into %s", len(keys), self.spool
                )
                return [False] * len(keys)
        return [key in self.corpus_pages for key in keys]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return None  # the v0 interface is not served; set "interface_v1": 1

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> Any:
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return key in self.corpus_pages  # held already, or refused: never written

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all(key in self.corpus_pages for key in keys)
