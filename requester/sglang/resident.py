"""What an SGLang worker keeps on its GPU for the device corpus path, and how it fills it.

All of it is allocated once, when the model is built (before SGLang captures its CUDA graphs), and
written in place afterwards, so a captured graph always reads the current state:

- the **arena**: per layer, the bound corpora's index keys as SGLang's own index-k pages
  (``[pages, P·D]`` float8 keys then ``P`` float32 scales, ``NSATokenToKVPool``'s format), so
  SGLang's fp8 indexer kernel scores them exactly as it scores a request's own keys;
- per arena page, the **holder slot and frame** that hold it;
- per SGLang request slot (``req_pool_idx``), the **arena page** of its corpus's first page and
  its corpus length (0 = unbound);
- per holder on this GPU, its **latent pools mapped by CUDA IPC**
  (:mod:`corpusd.transport.cuda_ipc`), all in one row format (:attr:`Resident.kv_format`):
  ``plain`` rows (bf16 ``[rows, 576]``; float32 in the CPU tests) or FlashMLA's fp8 rows (uint8
  ``[rows, 656]``, whole 64-row blocks; ``corpusd/kernels/fp8_cache.py``).

A corpus is loaded at the first prefill that names it (outside any graph): its index keys are
streamed from the holders (corpusd's fan-out engine, with its failover) and its page table is read
from the coordinator. Its pages must sit on holders mapped here; the window (the corpus length a
decode step scores, fixed at graph capture) must cover it. Otherwise the binding is refused with
what to change.

Each page is read from its first replica, the placement's own frame, never from a load replica
the coordinator added for a hot holder: the map is not re-read (NOTES.md, item 4), and a copy's
frames are released a grace after the copy leaves the page table, when the holder may give them
to another corpus — a graph reading them would get another corpus's rows, with no call to fail.
A holder that dies is the one reason to read another replica (:meth:`Resident.fail_over`, driven
by :mod:`.device_failover`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from corpusd.kernels.flashmla import check_pool
from corpusd.kernels.formats import KV_FORMATS
from indexer import fp8
from requester.corpus_view import CorpusView
from requester.fanout_device import DevicePlan, NoDeviceTransport, plan_device
from requester.sglang.binding import CorpusBindingError

log = logging.getLogger("corpusd.sglang")


def index_pages(keys: torch.Tensor, page_size: int, ue8m0: bool) -> torch.Tensor:
    """``keys [T, D]`` (the model's index keys) → uint8 ``[ceil(T/P), P·(D + 4)]`` in SGLang's
    index-k page format, the last page zero-padded; each page equals
    :func:`.pagehash.index_k_page` of its rows."""
    t, d = keys.shape
    n = math.ceil(t / page_size)
    padded = keys.new_zeros(n * page_size, d)
    padded[:t] = keys
    q, scale = fp8.quantize(fp8.rotate_round(padded), ue8m0)  # [N, D] fp8, [N, D/128]
    assert scale.shape[1] == 1, f"index keys {d} wide: SGLang's pages hold one scale per token"
    qb = q.view(torch.uint8).reshape(n, page_size * d)
    sb = scale.float().contiguous().view(torch.uint8).reshape(n, page_size * 4)
    return torch.cat([qb, sb], dim=1)


def placement(view: CorpusView) -> tuple[tuple[str, int], ...]:
    """Per page of ``view``, the (holder address, frame) the arena reads it from: its first
    replica, the placement's, never a load replica's copy (NOTES.md, item 4 (c))."""
    return tuple((view.holders[r[0][0]], int(r[0][1])) for r in view.replicas)


@dataclass(frozen=True, slots=True)
class ArenaCorpus:
    corpus_id: str
    base_page: int
    n_pages: int
    tokens: int
    #: per page, the (holder address, frame) its rows are read from: what the arena's tables
    #: hold, kept on the host so a changed placement is found without reading the GPU
    placement: tuple[tuple[str, int], ...] = ()
    #: the device plan the tables hold now: ``placement`` until a holder fails (fail_over)
    plan: DevicePlan | None = None


@dataclass(frozen=True, slots=True)
class FailedOver:
    """One corpus's pages moved off failed holders: to another live replica, or ``kept`` on the
    failed holder's still-mapped pool."""

    corpus_id: str
    replica: int
    kept: int


class Resident:
    """The device path's tables (see the module docstring). ``window_tokens``: the longest
    corpus a step scores; ``arena_tokens``: all loaded corpora together; ``req_slots``: SGLang's
    request pool size."""

    def __init__(
        self,
        n_layers: int,
        page_size: int,
        index_dim: int,
        arena_tokens: int,
        window_tokens: int,
        device: torch.device | str,
        ue8m0: bool,
        req_slots: int = 0,
        stage_rows: int = 0,
        one_call: bool = False,
    ) -> None:
        p = page_size
        #: query rows a time whose selected rows are copied to this GPU before the kernel when a
        #: pool sits on another GPU (``device.staged_partial``; 0: read in place)
        self.stage_rows = stage_rows
        #: own tokens and corpus rows attended in one kernel call (``device.one_call_partial``)
        self.one_call = one_call
        self.n_layers, self.page_size, self.index_dim = n_layers, p, index_dim
        self.device, self.ue8m0 = torch.device(device), ue8m0
        self.arena_pages = math.ceil(arena_tokens / p)
        self.window_pages = math.ceil(window_tokens / p)
        dev = self.device
        self.pages = [
            torch.zeros(self.arena_pages, p * (index_dim + 4), dtype=torch.uint8, device=dev)
            for _ in range(n_layers)
        ]
        self.page_holder = torch.full((self.arena_pages,), -1, dtype=torch.int32, device=dev)
        self.page_frame = torch.zeros(self.arena_pages, dtype=torch.int32, device=dev)
        self.req_base = torch.zeros(req_slots, dtype=torch.int32, device=dev)
        self.req_tokens = torch.zeros(req_slots, dtype=torch.int32, device=dev)
        self.pools: list[list[torch.Tensor]] = []  # [holder slot][layer] → [rows, kv_dim]
        self.holder_slot: dict[str, int] = {}  # holder address → slot
        self.transport: dict[str, str] = {}  # holder address → how it is mapped (cuda_ipc, …)
        self.incarnation: dict[str, str] = {}  # holder address → the mapped pools' process
        self.dead: set[str] = set()  # mapped holders failed over (fail_over)
        self.kv_format: str | None = None  # the mapped pools' row format (KV_FORMATS)
        self.corpora: dict[str, ArenaCorpus] = {}
        self.retired: dict[str, ArenaCorpus] = {}  # forgotten: admitted requests may still use
        self._next_page = 0

    @property
    def staged(self) -> bool:
        """Whether the corpus partial copies the selected rows here first (``stage_rows`` > 0):
        when some mapped pool is on another GPU (``cuda_p2p``). Decided when the pools are
        mapped, before any graph is captured, so it cannot follow where a corpus's pages land:
        pools on this GPU alone are read in place, since a server maps every holder of its GPU
        and one of them may hold every page (``tools/bench_peer_read.py --same-gpu``, 128 rows:
        one pool 236 µs a layer in place against 383 staged; a corpus split over two pools 521
        in place against 391 staged)."""
        return self.stage_rows > 0 and "cuda_p2p" in self.transport.values()

    @property
    def window_tokens(self) -> int:
        return self.window_pages * self.page_size

    # -- set-up (before graph capture) -------------------------------------------------------------
    def size_requests(self, req_slots: int) -> None:
        """Make room for ``req_slots`` request slots (SGLang's request pool size, known at the
        first forward, which runs before any graph is captured; it never changes after)."""
        if req_slots > self.req_base.shape[0]:
            self.req_base = torch.zeros(req_slots, dtype=torch.int32, device=self.device)
            self.req_tokens = torch.zeros(req_slots, dtype=torch.int32, device=self.device)
            log.info("corpusd plugin: %d request slots", req_slots)

    def add_pool(
        self, address: str, layers: list[torch.Tensor], transport: str = "cuda_ipc"
    ) -> int:
        """Map holder ``address``'s pools (one tensor per layer, :meth:`pool_format`), reached
        over ``transport`` (:data:`requester.fanout_device.TRANSPORTS`: ``cuda_ipc`` on this GPU,
        ``cuda_p2p`` on a peer GPU); returns its slot. Raises CorpusBindingError for a pool of
        another shape or format than the pools mapped before it (the device path attends one
        row format)."""
        assert len(layers) == self.n_layers, f"{address}: {len(layers)=} vs {self.n_layers=}"
        fmt = self.pool_format(address, layers)
        if self.kv_format is not None and fmt != self.kv_format:
            raise CorpusBindingError(
                f"holder {address} holds {fmt} rows, holders {sorted(self.holder_slot)} hold "
                f"{self.kv_format} rows: the device path attends one row format per server; "
                f"restart the holders on this GPU with one --kv-format (and pin for it)"
            )
        self.kv_format = fmt
        self.transport[address] = transport
        self.holder_slot[address] = len(self.pools)
        self.pools.append(layers)
        return self.holder_slot[address]

    @staticmethod
    def pool_format(address: str, layers: list[torch.Tensor]) -> str:
        """The row format of holder ``address``'s per-layer pools: ``plain`` (float rows ``[rows,
        d]``) or ``fp8_e4m3`` (uint8 ``[rows, 656]``, rows whole 64-row blocks). Raises
        CorpusBindingError, naming the holder and the shape, for anything else or for layers that
        differ. Reads only shapes and dtypes (meta tensors do)."""
        first = layers[0]
        for i, t in enumerate(layers):
            if t.dtype != first.dtype or t.shape != first.shape:
                raise CorpusBindingError(
                    f"holder {address}: layer {i}'s pool is {t.dtype} {list(t.shape)}, layer 0's "
                    f"{first.dtype} {list(first.shape)}"
                )
        if first.dtype == torch.uint8:
            try:
                check_pool(first)
            except ValueError as e:
                raise CorpusBindingError(f"holder {address}: {e}") from e
            return KV_FORMATS[1]
        if not first.is_floating_point() or first.dim() != 2:
            raise CorpusBindingError(
                f"holder {address}: a pool of {first.dtype} {list(first.shape)} is neither float "
                f"rows [rows, d] nor fp8 rows (uint8 [rows, 656])"
            )
        return KV_FORMATS[0]

    # -- loading (eager, at bind) ------------------------------------------------------------------
    def check(self, corpus_id: str, tokens: int, view: CorpusView | None = None) -> None:
        """Raise CorpusBindingError when corpus ``corpus_id`` cannot be served here."""
        if tokens > self.window_tokens:
            raise CorpusBindingError(
                f"corpus {corpus_id} has {tokens:,} tokens; this SGLang server scores at most "
                f"{self.window_tokens:,} per step (set CORPUSD_SGLANG_WINDOW and restart it)"
            )
        if corpus_id not in self.corpora:
            need = math.ceil(tokens / self.page_size)
            if self._next_page + need > self.arena_pages:
                raise CorpusBindingError(
                    f"corpus {corpus_id} needs {need} arena pages, "
                    f"{self.arena_pages - self._next_page} are free (set CORPUSD_SGLANG_ARENA "
                    "larger and restart the server)"
                )
        if view is not None:
            self.plan(view)

    def plan(self, view: CorpusView) -> DevicePlan:
        """``view``'s device plan (:mod:`requester.fanout_device`) over the holders mapped here,
        each by the transport it was mapped with, none read from a holder failed over since.
        Raises CorpusBindingError when a page's first replica is on a holder not mapped here,
        or only on failed ones."""
        try:
            return plan_device(view, self.transport, self.dead)
        except NoDeviceTransport as e:
            missing = sorted({view.holders[r[0][0]] for r in view.replicas} - set(self.holder_slot))
            if not missing:  # every first replica mapped: some page lives only on failed holders
                raise CorpusBindingError(
                    f"{e}; a holder restarted at a failed one's address is mapped only by a "
                    "restarted SGLang server"
                ) from None
            raise CorpusBindingError(
                f"corpus {view.corpus_id} has pages on holders {missing}, which are neither on "
                f"this GPU nor on a GPU it reaches by peer access (or started after this server); "
                f"with CUDA graphs on the plugin serves corpora from holders on the GPUs it "
                f"sees (CUDA_VISIBLE_DEVICES) and reaches over NVLink"
            ) from None

    def load(self, view: CorpusView, keys: list[torch.Tensor]) -> ArenaCorpus:
        """Place ``view``'s corpus in the arena: its index keys as pages (per layer float keys
        ``[T, D]``, or an engine pin's pages as SGLang computed them, uint8 ``[n_pages, P·(D +
        4)]``, placed as they are), each page's first replica as (holder slot, frame), whichever
        replica ``view`` chose (its device plan, :meth:`plan`). Idempotent; raises
        CorpusBindingError."""
        cid = view.corpus_id
        if cid in self.corpora:
            return self.corpora[cid]
        self.check(cid, view.token_count)
        plan = self.plan(view)
        assert len(keys) == self.n_layers, f"{len(keys)=} vs {self.n_layers=}"
        n, base = view.n_pages, self._next_page
        for layer, k in enumerate(keys):
            if k.dtype == torch.uint8:
                assert k.shape[0] == n, f"{k.shape=} for {n} pages"
                pages = k
            else:
                pages = index_pages(k[: view.token_count], self.page_size, self.ue8m0)
            self.pages[layer][base : base + n] = pages.to(self.device)
        self._place(base, plan)
        self._next_page += n
        c = ArenaCorpus(cid, base, n, view.token_count, placement(view), plan)
        self.corpora[cid] = c
        self.retired.pop(cid, None)
        log.info("corpus %s resident: %d pages at arena page %d", cid, n, base)
        return c

    def fail_over(self, failed: set[str]) -> list[FailedOver]:
        """Read no page from the holders ``failed`` (mapped here, found dead): every corpus in
        the arena, loaded or retired (admitted requests still read those), is re-planned
        (:meth:`requester.fanout_device.DevicePlan.failover`) and its arena rows of holder slot
        and frame rewritten in place. Between steps only, on the stream the next step runs on,
        never while a graph that reads them replays. A corpus's ``placement`` stays its page
        table's (what a recheck compares). Corpora planned later leave ``failed`` out
        (:meth:`plan`). Returns what moved, per corpus that read a failed holder. A page no
        live replica holds stays on its failed holder's pool (CUDA IPC keeps it mapped: pinned
        rows, unchanged), counted as ``kept``."""
        new = set(failed) - self.dead
        self.dead |= new
        out = []
        for table in (self.corpora, self.retired):
            for cid, c in list(table.items()):
                if c.plan is None or not new & {a for a, _ in c.plan.placement}:
                    continue
                plan = c.plan.failover(new)  # never raises: every pool here is CUDA IPC's
                self._place(c.base_page, plan)
                if table.get(cid) is c:  # not forgotten meanwhile (a recheck on another thread)
                    table[cid] = replace(c, plan=plan)
                replica, kept = plan.moved(c.plan)
                out.append(FailedOver(cid, replica, kept))
        return out

    def _place(self, base: int, plan: DevicePlan) -> None:
        """Write ``plan``'s (holder slot, frame) per page into the arena from page ``base``."""
        placed, n = plan.placement, plan.n_pages
        slots = [self.holder_slot[address] for address, _ in placed]
        self.page_holder[base : base + n] = torch.tensor(slots, dtype=torch.int32).to(self.device)
        frames = torch.tensor([f for _, f in placed], dtype=torch.int32)
        self.page_frame[base : base + n] = frames.to(self.device)

    def forget(self, corpus_id: str) -> bool:
        """Drop ``corpus_id`` from the loaded corpora (unpinned, or placed anew): the next load
        places it again from its current page table. Requests already bound keep the tables
        their prefill recorded, and one admitted but not yet prefilled is served as it was
        (``retired``); the arena's pages are not reused (it only grows). True when it was
        loaded."""
        c = self.corpora.pop(corpus_id, None)
        if c is not None:
            self.retired[corpus_id] = c
        return c is not None

    def bind(self, req_slots: torch.Tensor, corpora: list[ArenaCorpus | None]) -> None:
        """Record each request slot's corpus (None: unbound) for the steps that follow."""
        base = torch.tensor([c.base_page if c else 0 for c in corpora], dtype=torch.int32)
        tokens = torch.tensor([c.tokens if c else 0 for c in corpora], dtype=torch.int32)
        idx = req_slots.to(self.device, torch.int64)
        self.req_base[idx] = base.to(self.device)
        self.req_tokens[idx] = tokens.to(self.device)

    # -- per step (graph-safe) ---------------------------------------------------------------------
    def rows_of(self, req_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(arena base page int32 ``[b]``, corpus length int32 ``[b]``) of request slots."""
        idx = req_slots.to(torch.int64)
        return self.req_base[idx], self.req_tokens[idx]

    def block_table(self, base: torch.Tensor) -> torch.Tensor:
        """int32 ``[n, window pages]``: row ``i``'s corpus page ``j`` → arena page (clamped into
        the arena; pages past a corpus's end are never scored as candidates)."""
        j = torch.arange(self.window_pages, device=base.device, dtype=torch.int32)
        return (base[:, None] + j[None, :]).clamp(max=self.arena_pages - 1)
