"""The plugin's page cache for ``fetch``: corpus pages pulled from holders, kept on the GPU beside
SGLang's own pool, read by the same sparse kernel (:func:`.device.sparse_partial`).

Per layer one tensor ``[slots · P, kv_dim]`` (corpusd's rope layout: ``c_KV`` 512 then ``k_pe``
64, as holders keep their pages; bf16 on CUDA, float32 on the CPU reference) and one
:class:`SlotLRU`, the map ``(corpus, page) → slot``. Layers are independent: a group decided
"fetch" at layer ``l`` pulls only layer ``l``'s pages. The budget is
``CORPUSD_SGLANG_PAGE_CACHE_MB`` for all layers together, split evenly; a layer's tensor is
allocated (NaN-filled, so a row read before it is filled shows) the first time the layer
fetches.

Within one forward step, pages a call uses are pinned: a later call of the same step (another
corpus at the same layer) may not evict them. ``new_step`` releases the pins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from corpusd import env

Key = tuple[str, int]  # (corpus id, page number)
ENV_MB = "CORPUSD_SGLANG_PAGE_CACHE_MB"


class PageCacheFull(RuntimeError):
    """The pages one call needs do not fit beside the pages pinned by this step."""


def cache_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``CORPUSD_SGLANG_PAGE_CACHE_MB`` in bytes (default 256 MB; 0 turns fetch off). Raises
    ValueError naming the variable for anything but a non-negative integer."""
    mb: int = env.get(ENV_MB, environ)
    return mb << 20


class SlotLRU:
    """``(corpus, page) → slot`` for ``slots`` slots, least recently used evicted first, never a
    slot pinned in the current step. Pure Python: no tensors."""

    def __init__(self, slots: int) -> None:
        assert slots >= 1, f"{slots=}"
        self.slots = slots
        self.map: OrderedDict[Key, int] = OrderedDict()  # LRU first
        self.free = list(range(slots - 1, -1, -1))  # pop() gives the lowest
        self.pinned: set[Key] = set()
        self.hits = self.misses = self.evictions = 0

    def new_step(self) -> None:
        self.pinned.clear()

    def acquire(self, keys: Sequence[Key]) -> tuple[list[int], list[int]]:
        """Slots for distinct ``keys``, each pinned for this step: hits are touched (most recent,
        in ``keys`` order) and pinned first, then each miss takes a free slot or evicts the least
        recently used unpinned page. Returns ``(slots, fill)``: ``slots[i]`` holds ``keys[i]``;
        ``fill`` are the indices into ``keys`` whose slot the caller must fill (or ``drop``).
        Raises PageCacheFull, changing nothing, when the misses do not fit."""
        assert len(set(keys)) == len(keys), "keys must be distinct"
        misses = [i for i, k in enumerate(keys) if k not in self.map]
        hits = set(keys) - {keys[i] for i in misses}
        evictable = sum(1 for k in self.map if k not in self.pinned and k not in hits)
        if len(misses) > len(self.free) + evictable:
            raise PageCacheFull(
                f"{len(keys)} pages asked, {len(misses)} of them new; {self.slots} slots, "
                f"{len(self.pinned | hits)} pinned by this step (raise {ENV_MB})"
            )
        out = [-1] * len(keys)
        for i, k in enumerate(keys):
            if k in self.map:
                self.map.move_to_end(k)
                self.pinned.add(k)
                out[i] = self.map[k]
        for i in misses:
            if self.free:
                slot = self.free.pop()
            else:
                old = next(k for k in self.map if k not in self.pinned)
                slot = self.map.pop(old)
                self.evictions += 1
            self.map[keys[i]] = slot
            self.pinned.add(keys[i])
            out[i] = slot
        self.hits += len(keys) - len(misses)
        self.misses += len(misses)
        return out, misses

    def drop(self, keys: Sequence[Key]) -> None:
        """Forget ``keys`` (a fill that failed): their slots are free again."""
        for k in keys:
            if k in self.map:
                self.free.append(self.map.pop(k))
                self.pinned.discard(k)
        self.free.sort(reverse=True)

    def check_integrity(self) -> None:
        used = list(self.map.values())
        assert len(set(used)) == len(used), f"a slot held twice: {sorted(used)}"
        assert not set(used) & set(self.free), "a slot both held and free"
        assert sorted(used + self.free) == list(range(self.slots)), "a slot lost"
        assert self.pinned <= set(self.map), "a pinned page not held"


@dataclass(frozen=True)
class Plan:
    """One call's view of the cache: ``rows`` int32 ``[n, k]`` (``slot · P + position % P``,
    -1 unused) into :meth:`PageCache.kv`; ``fill_pages`` / ``fill_slots`` what to pull and
    where it goes (page numbers ascending)."""

    rows: torch.Tensor
    fill_pages: list[int]
    fill_slots: list[int]


class PageCache:
    """Per-layer slot tensors and LRU maps (see the module docstring)."""

    def __init__(
        self,
        n_layers: int,
        page_size: int,
        kv_dim: int,
        capacity_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        page_bytes = page_size * kv_dim * torch.empty(0, dtype=dtype).element_size()
        slots = capacity_bytes // n_layers // page_bytes
        if slots < 1:
            need = -(-n_layers * page_bytes // (1 << 20))
            raise ValueError(
                f"corpusd plugin: {ENV_MB}={capacity_bytes >> 20} holds no page per layer "
                f"({n_layers} layers × {page_bytes} bytes a page); give at least {need}, or 0 "
                f"to turn fetch off"
            )
        self.page_size, self.kv_dim, self.dtype, self.device = page_size, kv_dim, dtype, device
        self.slots = slots
        self.lru = [SlotLRU(slots) for _ in range(n_layers)]
        self._kv: dict[int, torch.Tensor] = {}

    def new_step(self) -> None:
        for lru in self.lru:
            lru.new_step()

    def kv(self, layer: int) -> torch.Tensor:
        """``[slots · P, kv_dim]`` of ``layer`` (allocated NaN-filled on first use)."""
        if layer not in self._kv:
            self._kv[layer] = torch.full(
                (self.slots * self.page_size, self.kv_dim), float("nan"),
                dtype=self.dtype, device=self.device,
            )  # fmt: skip
        return self._kv[layer]

    def missing(self, layer: int, corpus_id: str, pages: Sequence[int]) -> int:
        """How many of ``pages`` a fetch would pull now (no change)."""
        return sum((corpus_id, p) not in self.lru[layer].map for p in pages)

    def plan(self, layer: int, corpus_id: str, positions: torch.Tensor) -> Plan:
        """Slots for the pages of canonical ``positions [n, k]`` (int64, -1 unused), pinned for
        this step. Raises PageCacheFull (nothing changed) when they do not fit."""
        p = self.page_size
        valid = positions >= 0
        pages = (positions[valid] // p).unique()  # ascending
        keys = [(corpus_id, int(pg)) for pg in pages.tolist()]
        slots, fill = self.lru[layer].acquire(keys)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=positions.device)
        pos = positions.clamp(min=0)
        at = torch.searchsorted(pages, pos // p).clamp(max=max(len(keys) - 1, 0))
        rows = slot_t[at] * p + pos % p if keys else torch.zeros_like(pos)
        rows = torch.where(valid, rows, -1).to(torch.int32)
        return Plan(rows, [keys[i][1] for i in fill], [slots[i] for i in fill])

    def fill(self, layer: int, slots: Sequence[int], latent: torch.Tensor) -> None:
        """Write ``latent [len(slots), P, kv_dim]`` (a Fetch's pages, any float dtype) into
        ``slots``."""
        assert latent.shape == (len(slots), self.page_size, self.kv_dim), (
            f"{latent.shape=} for {len(slots)} slots of {self.page_size} × {self.kv_dim}"
        )
        p = self.page_size
        kv = self.kv(layer)
        idx = (torch.tensor(slots, dtype=torch.int64)[:, None] * p + torch.arange(p)).flatten()
        kv[idx.to(kv.device)] = latent.reshape(-1, self.kv_dim).to(kv.device, self.dtype)

    def drop(self, layer: int, corpus_id: str, pages: Sequence[int]) -> None:
        self.lru[layer].drop([(corpus_id, p) for p in pages])

    def stats(self) -> dict[str, int]:
        """Totals over layers: hits, misses, evictions (pages), resident pages."""
        return {
            "hits": sum(x.hits for x in self.lru),
            "misses": sum(x.misses for x in self.lru),
            "evictions": sum(x.evictions for x in self.lru),
            "resident": sum(len(x.map) for x in self.lru),
        }
