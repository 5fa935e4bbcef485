"""The SGLang plugin's fetch page cache (requester/sglang/page_cache.py) against a plain-list
reference LRU, and its rows against the source pages (CPU; no sglang)."""

from __future__ import annotations

import random

import pytest
import torch

from requester.sglang.page_cache import (
    ENV_MB,
    PageCache,
    PageCacheFull,
    SlotLRU,
    cache_bytes,
)

Key = tuple[str, int]


class RefLRU:
    """The rule, spelt out: a recency list (least recent first) of at most ``cap`` keys; a call
    touches and pins its hits (in call order), then appends each miss, evicting the least
    recent unpinned key when full; a call whose misses do not fit changes nothing."""

    def __init__(self, cap: int) -> None:
        self.cap, self.order, self.pinned = cap, [], set()  # type: ignore[var-annotated]
        self.evicted: list[Key] = []

    def call(self, keys: list[Key]) -> list[Key] | None:
        misses = [k for k in keys if k not in self.order]
        protected = self.pinned | set(keys)
        room = self.cap - len(self.order) + sum(k not in protected for k in self.order)
        if len(misses) > room:
            return None
        for k in keys:
            if k in self.order:
                self.order.remove(k)
                self.order.append(k)
                self.pinned.add(k)
        for k in misses:
            if len(self.order) == self.cap:
                old = next(x for x in self.order if x not in self.pinned)
                self.order.remove(old)
                self.evicted.append(old)
            self.order.append(k)
            self.pinned.add(k)
        return misses


@pytest.mark.parametrize("cap", [1, 2, 3, 7])
def test_slot_lru_matches_the_reference_on_random_sequences(cap: int) -> None:
    rng = random.Random(cap)
    for _ in range(40):
        lru, ref = SlotLRU(cap), RefLRU(cap)
        owner: dict[int, Key] = {}  # what each slot holds, as the caller filled it
        for _ in range(60):
            if rng.random() < 0.3:
                lru.new_step()
                ref.pinned.clear()
            pool = [(c, p) for c in ("a", "b") for p in range(5)]
            keys = rng.sample(pool, rng.randint(0, min(cap + 1, len(pool))))
            want = ref.call(keys)
            if want is None:
                before = (list(lru.map.items()), list(lru.free), set(lru.pinned))
                with pytest.raises(PageCacheFull, match=ENV_MB):
                    lru.acquire(keys)
                assert (list(lru.map.items()), list(lru.free), set(lru.pinned)) == before
                continue
            slots, fill = lru.acquire(keys)
            assert [keys[i] for i in fill] == want
            for i in fill:
                owner[slots[i]] = keys[i]
            # every key of the call is held in its slot, and the slot holds that key's data
            assert all(owner[s] == k for s, k in zip(slots, keys, strict=True))
            assert list(lru.map) == ref.order and lru.pinned == ref.pinned
            assert lru.evictions == len(ref.evicted)
            lru.check_integrity()


def test_in_step_pin_and_capacity_one() -> None:
    lru = SlotLRU(1)
    with pytest.raises(PageCacheFull):
        lru.acquire([("a", 0), ("a", 1)])  # two pages, one slot
    assert lru.acquire([("a", 0)]) == ([0], [0])
    assert lru.acquire([("a", 0)]) == ([0], [])  # a hit, still pinned
    with pytest.raises(PageCacheFull, match="1 pinned by this step"):
        lru.acquire([("b", 0)])  # another corpus, same step: may not evict a pinned page
    lru.new_step()
    assert lru.acquire([("b", 0)]) == ([0], [0]) and lru.evictions == 1
    assert list(lru.map) == [("b", 0)]
    lru.drop([("b", 0)])  # a failed fill
    assert not lru.map and lru.free == [0] and not lru.pinned
    lru.check_integrity()


def test_lru_evicts_least_recent_unpinned() -> None:
    lru = SlotLRU(3)
    lru.acquire([("a", 0), ("a", 1), ("a", 2)])
    lru.new_step()
    lru.acquire([("a", 0)])  # most recent now, and pinned
    _, fill = lru.acquire([("a", 3)])  # evicts page 1, the least recent unpinned
    assert fill == [0] and ("a", 1) not in lru.map and next(iter(lru.map)) == ("a", 2)


def _corpus(pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, 64, 576, generator=g)


def test_page_cache_rows_read_the_selected_positions() -> None:
    """Random selections over two corpora, a cache smaller than the corpora: after each plan +
    fill, the cache rows of every selected position are that position's row (bit for bit in
    float32; bf16-rounded in bf16), unused slots are -1, and evicted slots are refilled."""
    src = {"a": _corpus(12, 1), "b": _corpus(9, 2)}
    for dtype in (torch.float32, torch.bfloat16):
        page_bytes = 64 * 576 * torch.empty(0, dtype=dtype).element_size()
        cache = PageCache(2, 64, 576, 2 * 6 * page_bytes, dtype, torch.device("cpu"))
        assert cache.slots == 6
        g = torch.Generator().manual_seed(3)
        for step in range(30):
            cache.new_step()
            for corpus in ("a", "b") if step % 2 else ("a",):
                layer = step % 2
                rows_src = src[corpus].reshape(-1, 576)
                pages = torch.randperm(len(src[corpus]), generator=g)[:3]
                pos = pages[torch.randint(0, 3, (4, 20), generator=g)] * 64
                pos = pos + torch.randint(0, 64, (4, 20), generator=g)
                pos[torch.rand(4, 20, generator=g) < 0.2] = -1
                plan = cache.plan(layer, corpus, pos)
                assert plan.fill_pages == sorted(plan.fill_pages)
                if plan.fill_pages:
                    cache.fill(layer, plan.fill_slots, src[corpus][plan.fill_pages])
                assert plan.rows.dtype == torch.int32
                assert torch.equal(plan.rows < 0, pos < 0)
                got = cache.kv(layer)[plan.rows[pos >= 0].long()]
                assert torch.equal(got, rows_src[pos[pos >= 0]].to(dtype))
            for lru in cache.lru:
                lru.check_integrity()
        st = cache.stats()
        assert st["evictions"] > 0 and st["hits"] > 0 and st["resident"] <= 12


def test_page_cache_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match=f"{ENV_MB}=1 holds no page per layer"):
        PageCache(61, 64, 576, 1 << 20, torch.bfloat16, torch.device("cpu"))
    cache = PageCache(1, 64, 576, 2 * 64 * 576 * 4, torch.float32, torch.device("cpu"))
    pos = torch.tensor([[0, 64, 128]])
    with pytest.raises(PageCacheFull):
        cache.plan(0, "a", pos)  # three pages, two slots
    assert cache.stats()["resident"] == 0
    fresh = cache.plan(0, "a", pos[:, :2])
    assert bool(cache.kv(0).isnan().all())  # unfilled rows are NaN: a read before a fill shows
    assert fresh.fill_pages == [0, 1]
    empty = cache.plan(0, "a", torch.full((2, 5), -1))
    assert bool((empty.rows == -1).all()) and empty.fill_pages == []


@pytest.mark.parametrize("raw", ["-1", "1.5", "lots"])
def test_cache_size_env_is_checked(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_MB}={raw!r}"):
        cache_bytes({ENV_MB: raw})
    assert cache_bytes({}) == 256 << 20 and cache_bytes({ENV_MB: " 0 "}) == 0
    assert cache_bytes({ENV_MB: " "}) == 256 << 20  # blank is unset, as for every variable
