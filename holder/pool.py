"""The frame pool: one preallocated latent tensor and one index-key tensor per layer.

A frame holds one page (``page_size`` rows). Pool row ``frame * page_size + slot`` is what
requesters address. The pool owns the free list, the frame table ``frame → (corpus, page)``,
and per frame its owner (a small corpus handle) and number of valid rows, so a request's rows
can be checked against the corpus it names in one vectorised pass (on the host,
``check_rows``; on the device, against ``row_mask``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from corpusd.corpus.manifest import page_format
from corpusd.kernels.formats import KV_FORMATS, ROW_BYTES

log = logging.getLogger("corpusd.holder")


@dataclass(frozen=True, slots=True)
class Geometry:
    """The pool's shape. A latent row is ``kv_dim`` wide: ``d_v`` values (``c_KV``, the model's
    kv_lora_rank: 512 for V3.2), then the rope band (qk_rope_head_dim: the other columns).
    ``d_v`` is what kernels take as the value width; it is the model's, never assumed.
    ``kv_format`` "fp8_e4m3" stores each latent row as FlashMLA's 656-byte fp8 row (uint8);
    ``dtype`` is then the index keys' and the partials' dtype."""

    n_layers: int
    page_size: int
    kv_dim: int
    index_dim: int
    dtype: torch.dtype
    frames: int
    device: str = "cpu"
    d_v: int = field(kw_only=True)
    kv_format: str = field(default="plain", kw_only=True)

    def __post_init__(self) -> None:
        assert min(self.n_layers, self.page_size, self.kv_dim, self.index_dim, self.frames) > 0, (
            f"{self=}"
        )
        assert 0 < self.d_v < self.kv_dim, f"d_v must be in 1..kv_dim - 1: {self=}"
        assert self.kv_format in KV_FORMATS, f"{self.kv_format=}"

    @property
    def fp8(self) -> bool:
        return self.kv_format != "plain"

    @property
    def latent_width(self) -> int:
        """Elements of a stored latent row: ``kv_dim``, or 656 bytes for fp8 rows."""
        return ROW_BYTES if self.fp8 else self.kv_dim

    @property
    def latent_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def page_format(self) -> str:
        """What this pool loads, as manifests and the coordinator's registry name it."""
        return page_format(str(self.dtype).removeprefix("torch."), self.kv_format)

    @property
    def bytes_per_frame(self) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        latent = self.latent_width * torch.empty((), dtype=self.latent_dtype).element_size()
        return self.n_layers * self.page_size * (latent + self.index_dim * elt)


@dataclass(slots=True)
class HeldCorpus:
    handle: int
    token_count: int
    n_pages: int
    pages: dict[int, int] = field(default_factory=dict)  # page → frame


class RowError(ValueError):
    """Requested pool rows that are out of range or not the named corpus's."""


class PoolFull(RuntimeError):
    """Not enough free frames."""


class FramePool:
    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        rows = geo.frames * geo.page_size
        dt, dev = geo.dtype, geo.device
        # fp8 pools round their rows up to FlashMLA's 64-row block (it reads the pool as
        # [blocks, 64, 1, 656]); the extra rows belong to no frame and are never addressed
        stored = -(-rows // 64) * 64 if geo.fp8 else rows
        self.latent = [
            torch.zeros(stored, geo.latent_width, dtype=geo.latent_dtype, device=dev)
            for _ in range(geo.n_layers)
        ]
        self.index_keys = [
            torch.zeros(rows, geo.index_dim, dtype=dt, device=dev) for _ in range(geo.n_layers)
        ]
        self.owner = torch.full((geo.frames,), -1, dtype=torch.int32)
        self.valid = torch.zeros(geo.frames, dtype=torch.int32)
        self.table: dict[int, tuple[str, int]] = {}
        self.corpora: dict[str, HeldCorpus] = {}
        self._free = list(range(geo.frames - 1, -1, -1))  # pop() hands out the lowest frame
        # Released frames of a pool shared over CUDA IPC wait ``reuse_delay_s`` before another
        # corpus may fill them (oldest first when the free list runs short): an SGLang worker's
        # decode graphs read the pool in place, and a request running across an unpin reads its
        # corpus's frames until it ends. (release time + delay, frame), oldest first.
        self.reuse_delay_s = 0.0
        self._cooling: deque[tuple[float, int]] = deque()
        self._next_handle = 0
        self.version = 0  # bumped whenever a frame changes owner or valid rows
        self._masks: dict[tuple[str, str], tuple[int, torch.Tensor]] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def free_frames(self) -> int:
        """Frames a new page may take, cooling ones included (they are taken last)."""
        return len(self._free) + len(self._cooling)

    @property
    def used_frames(self) -> int:
        return self.geo.frames - self.free_frames

    @property
    def cooling_frames(self) -> int:
        return len(self._cooling)

    def held(self, corpus_id: str) -> HeldCorpus | None:
        return self.corpora.get(corpus_id)

    def check_rows(self, corpus_id: str, rows: torch.Tensor) -> None:
        """Raise RowError unless every row ≥ 0 is a valid row of a frame of ``corpus_id``
        (``-1`` marks an unused slot and is allowed). ``rows``: int32 or int64, read as is."""
        held = self.corpora[corpus_id]
        used = rows[rows >= 0]
        if bool((rows < -1).any()):
            raise RowError(f"row indices below -1: {rows[rows < -1][:4].tolist()}")
        if used.numel() == 0:
            return
        limit = self.geo.frames * self.geo.page_size
        if int(used.max()) >= limit:
            raise RowError(f"row {int(used.max())} is outside the pool (0..{limit - 1})")
        frames = used // self.geo.page_size
        slots = used % self.geo.page_size
        wrong = self.owner[frames] != held.handle
        if bool(wrong.any()):
            row = int(used[wrong][0])
            raise RowError(f"row {row} is not in a frame of corpus {corpus_id}")
        past = slots >= self.valid[frames]
        if bool(past.any()):
            raise RowError(f"row {int(used[past][0])} is past the corpus's last token")

    def row_mask(self, corpus_id: str, device: torch.device | str) -> torch.Tensor:
        """bool ``[frames · page_size]`` on ``device``: True at the pool rows that hold a token of
        ``corpus_id`` (what ``check_rows`` accepts), rebuilt after any change of the pool.
        Raises KeyError when the corpus is not held."""
        key = (corpus_id, str(device))
        cached = self._masks.get(key)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        held = self.corpora[corpus_id]
        p = self.geo.page_size
        owned = (self.owner == held.handle).repeat_interleave(p)
        in_page = torch.arange(p).repeat(self.geo.frames) < self.valid.repeat_interleave(p)
        mask = (owned & in_page).to(device)
        self._masks[key] = (self.version, mask)
        return mask

    # -- mutation ---------------------------------------------------------------------------------
    def add_corpus(self, corpus_id: str, token_count: int, n_pages: int) -> HeldCorpus:
        held = self.corpora.get(corpus_id)
        if held is None:
            held = HeldCorpus(self._next_handle, token_count, n_pages)
            self._next_handle += 1
            self.corpora[corpus_id] = held
        return held

    def take_frames(self, n: int, wanted: list[int] | None = None) -> list[int]:
        """Reserve ``n`` free frames (the ``wanted`` ones when given: restart restores frames).
        Cooling frames (``reuse_delay_s``) are taken only when the free list is short, oldest
        first, and logged."""
        # restore (``wanted``) runs at start, before anything can read this pool
        self._thaw(float("inf") if wanted is not None else time.monotonic())
        if wanted is not None:
            missing = [f for f in wanted if f not in self._free]
            if missing:
                raise PoolFull(f"frames {missing[:4]} are not free")
            for f in wanted:
                self._free.remove(f)
            return wanted
        if n > self.free_frames:
            raise PoolFull(f"{n} frames needed, {self.free_frames} free of {self.geo.frames}")
        short = n - len(self._free)
        if short > 0:
            left = self._cooling[short - 1][0] - time.monotonic()
            log.warning(
                "pool short of frames: %d released %.1f s or less before their reuse delay ends "
                "are filled now; an SGLang worker reading this pool in place may still read "
                "them (a request running across its corpus's unpin)", short, left,
            )  # fmt: skip
            self._free.extend(self._cooling.popleft()[1] for _ in range(short))
            self._free.sort(reverse=True)
        return [self._free.pop() for _ in range(n)]

    def return_frames(self, frames: list[int]) -> None:
        for f in frames:
            self.owner[f] = -1
            self.valid[f] = 0
            self.table.pop(f, None)
        self.version += 1
        if self.reuse_delay_s > 0:
            until = time.monotonic() + self.reuse_delay_s
            self._cooling.extend((until, f) for f in frames)
            return
        self._free.extend(frames)
        self._free.sort(reverse=True)

    def _thaw(self, now: float) -> None:
        """Cooling frames whose delay has passed by ``now`` become free."""
        thawed = False
        while self._cooling and self._cooling[0][0] <= now:
            self._free.append(self._cooling.popleft()[1])
            thawed = True
        if thawed:
            self._free.sort(reverse=True)

    def fill(
        self,
        corpus_id: str,
        page: int,
        frame: int,
        latent: list[torch.Tensor],
        keys: list[torch.Tensor],
    ) -> None:
        """Copy one page (per layer ``[P, latent_width]`` / ``[P, index_dim]``) into ``frame``."""
        held = self.corpora[corpus_id]
        p = self.geo.page_size
        lo = frame * p
        for layer in range(self.geo.n_layers):
            self.latent[layer][lo : lo + p] = latent[layer]
            self.index_keys[layer][lo : lo + p] = keys[layer]
        self.valid[frame] = min(p, held.token_count - page * p)
        self.owner[frame] = held.handle
        self.table[frame] = (corpus_id, page)
        held.pages[page] = frame
        self.version += 1

    def drop_if_empty(self, corpus_id: str) -> None:
        held = self.corpora.get(corpus_id)
        if held is not None and not held.pages:
            del self.corpora[corpus_id]

    def release(self, corpus_id: str, pages: list[int] | None = None) -> int:
        held = self.corpora.get(corpus_id)
        if held is None:
            return 0
        # a page named twice is freed once (a KeyError on the second pop was an INTERNAL)
        chosen = list(held.pages) if not pages else sorted(set(pages) & held.pages.keys())
        frames = [held.pages.pop(p) for p in chosen]
        self.return_frames(frames)
        if not held.pages:
            del self.corpora[corpus_id]
            self._masks = {k: v for k, v in self._masks.items() if k[0] != corpus_id}
        return len(frames)

    def check_integrity(self) -> None:
        """Assert that free list, frame table, owners and corpora agree (run when idle)."""
        free = set(self._free) | {f for _, f in self._cooling}
        assert len(free) == len(self._free) + len(self._cooling), "free list has duplicates"
        assert free.isdisjoint(self.table), (
            f"frames both free and used: {sorted(free & set(self.table))[:4]}"
        )
        assert len(free) + len(self.table) == self.geo.frames, (
            f"{len(free)=} + {len(self.table)=} != {self.geo.frames=}"
        )
        handles = {c.handle: cid for cid, c in self.corpora.items()}
        for frame, (cid, page) in self.table.items():
            held = self.corpora.get(cid)
            assert held is not None and held.pages.get(page) == frame, f"{frame=} {cid=} {page=}"
            assert handles.get(int(self.owner[frame])) == cid, f"{frame=} owner mismatch"
        assert bool((self.owner[sorted(free)] == -1).all()) if free else True, "free frame owned"


def rows_outside(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``rows``' device: some entry of ``rows`` is neither −1 (unused) nor a row
    ``mask`` (``FramePool.row_mask``) accepts. ``rows``: int32 or int64, indexed as is (no
    widened copy). Tensor ops only, no host sync, so it can run beside a kernel or inside a
    captured CUDA graph."""
    n_rows = mask.shape[0]
    used = rows >= 0
    owned = mask[rows.clamp(0, n_rows - 1)]
    return ((rows < -1) | (used & ((rows >= n_rows) | ~owned))).any()
