"""The SGLang plugin's device path over holder pools of FlashMLA's fp8 rows, on CPU: the corpus
partial against ``fp8_partial_attention`` over the same rows, the pool-format checks of the
mapping (``Resident.add_pool`` / ``CorpusLink.map_holders``, with the coordinator, the holders'
SharePool and CUDA IPC faked), the torch index preparation of the shared FlashMLA wrapper, and the
worker/holder format pairing (``formats.py``). No sglang, no GPU, no processes."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from corpusd.kernels import fp8_cache as f8
from corpusd.kernels.flashmla import prep_indices
from corpusd.model import ModelConfig
from corpusd.testing.numeric import rel
from corpusd.transport import cuda_ipc
from requester.corpus_view import CorpusView
from requester.sglang import catalog, device, formats
from requester.sglang import link as link_mod
from requester.sglang.binding import CorpusBindingError
from requester.sglang.resident import Resident

SEED = 20261125
D, D_V, P = 576, 512, 64
FRAMES = 40


def _resident(layers: int = 2) -> Resident:
    return Resident(
        n_layers=layers, page_size=P, index_dim=128, arena_tokens=2048, window_tokens=1024,
        device="cpu", ue8m0=False, req_slots=8,
    )  # fmt: skip


def _fp8_pool(g: torch.Generator) -> torch.Tensor:
    """uint8 ``[FRAMES·64, 656]`` from random bf16 rows of varied magnitude, every row poisoned
    with NaN codes (0x7F) until a corpus page is written over it: reading a frame no page maps
    makes the partial NaN."""
    rows = FRAMES * P
    lat = torch.randn(rows, D, generator=g) * torch.exp2(torch.randint(-3, 4, (rows, 1)))
    pool = f8.quantize(lat.bfloat16())
    pool[:, :D_V] = 0x7F
    return pool


def test_corpus_partial_over_fp8_pools_is_the_fp8_reference() -> None:
    g = torch.Generator().manual_seed(SEED)
    res = _resident()
    holders = ("h0", "h1", "h2")
    pools = {a: [_fp8_pool(g) for _ in range(2)] for a in holders}
    for a in holders:
        res.add_pool(a, pools[a])
    assert res.kv_format == "fp8_e4m3"
    tokens = 450  # 8 pages, the last one partly zero padding
    n_pages = math.ceil(tokens / P)
    ph = torch.randint(0, 3, (n_pages,), generator=g)
    pf = torch.randperm(FRAMES, generator=g)[:n_pages]
    reps = tuple(((int(h), int(f)),) for h, f in zip(ph, pf, strict=True))
    view = CorpusView("c", tokens, P, holders[::-1], ph, pf, reps)  # index order ≠ slot order
    # The corpus's own rows (bf16, quantized into its frames); one all-zero row, as the zero
    # padding of a last page is stored (scale 0, codes 0).
    rows = [torch.randn(n_pages * P, D, generator=g).bfloat16() for _ in range(2)]
    rows[1][7] = 0
    for layer in range(2):
        packed = f8.quantize(rows[layer])
        for p in range(n_pages):
            frame = int(pf[p])
            pools[view.holders[int(ph[p])]][layer][frame * P : (frame + 1) * P] = packed[
                p * P : (p + 1) * P
            ]
    c = res.load(view, [torch.randn(tokens, 128, generator=g) for _ in range(2)])
    res.bind(torch.tensor([0, 1, 2, 3]), [c, c, None, c])
    base, _ = res.rows_of(torch.tensor([0, 1, 2, 3]))

    n, h, k = 4, 16, 128
    q = torch.randn(n, h, D, generator=g).bfloat16()
    pos = torch.stack([torch.randperm(tokens, generator=g)[:k] for _ in range(n)])
    pos[0, 40:] = -1  # unused slots
    pos[1, 0] = 7  # the all-zero row
    pos[2] = -1  # an unbound row: nothing of a corpus
    pos[3, ::3] = -1
    scale = D**-0.5
    for layer in range(2):
        o, lse = device.corpus_partial(res, layer, q, pos, base, scale, D_V, base2=False)
        canon = f8.quantize(rows[layer])  # the corpus laid out by position
        want_o, want_l = f8.fp8_partial_attention(q.float(), canon, pos, scale, D_V)
        fin = torch.isfinite(want_l)
        assert not o.isnan().any(), f"{layer=}: a frame no page maps was read"
        assert rel(o, want_o) < 1e-5 and rel(lse[fin], want_l[fin]) < 1e-6, f"{layer=}"
        assert torch.equal(torch.isinf(lse), ~fin) and bool((o[2] == 0).all())
        assert o.dtype == torch.float32 and lse.shape == (n, h)


def test_one_fp8_pool_takes_the_single_holder_path() -> None:
    g = torch.Generator().manual_seed(SEED + 1)
    res = _resident(layers=1)
    pool = f8.quantize(torch.randn(FRAMES * P, D, generator=g).bfloat16())
    res.add_pool("h0", [pool])
    frames = (5, 1, 9, 2)
    view = CorpusView("c", 200, P, ("h0",), torch.zeros(4, dtype=torch.int64),
                      torch.tensor(frames), tuple(((0, f),) for f in frames))  # fmt: skip
    c = res.load(view, [torch.randn(200, 128, generator=g)])
    res.bind(torch.tensor([0]), [c])
    base, _ = res.rows_of(torch.tensor([0]))
    q = torch.randn(1, 8, D, generator=g).bfloat16()
    pos = torch.tensor([[0, 63, 64, 199, -1, 130]])
    o, lse = device.corpus_partial(res, 0, q, pos, base, 0.1, D_V, base2=False)
    rows = torch.tensor([[5 * 64, 5 * 64 + 63, 64, 2 * 64 + 7, -1, 9 * 64 + 2]])
    want_o, want_l = f8.fp8_partial_attention(q.float(), pool, rows, 0.1, D_V)
    assert rel(o, want_o) < 1e-6 and rel(lse, want_l) < 1e-6


def test_the_mapping_takes_one_pool_format_and_shapes_flashmla_reads() -> None:
    fp8 = [torch.zeros(128, 656, dtype=torch.uint8) for _ in range(2)]
    bf16 = [torch.zeros(128, D, dtype=torch.bfloat16) for _ in range(2)]
    res = _resident()
    res.add_pool("gpu-holder-a", fp8)
    with pytest.raises(CorpusBindingError, match=r"holder gpu-holder-b holds plain rows, holders "
                       r"\['gpu-holder-a'\] hold fp8_e4m3 rows.*one --kv-format"):  # fmt: skip
        res.add_pool("gpu-holder-b", bf16)
    assert res.holder_slot == {"gpu-holder-a": 0} and len(res.pools) == 1  # nothing half-added
    res = _resident()
    res.add_pool("a", bf16)
    with pytest.raises(CorpusBindingError, match="holder b holds fp8_e4m3 rows"):
        res.add_pool("b", fp8)
    u8 = torch.uint8
    bad = {
        "whole 64-row blocks.*got 100 rows": [torch.zeros(100, 656, dtype=u8)] * 2,
        r"uint8 \[rows, 656\].*got torch.uint8 \[128, 576\]": [torch.zeros(128, D, dtype=u8)] * 2,
        r"layer 1's pool is torch.uint8 \[192, 656\], layer 0's torch.uint8 \[128, 656\]": [
            fp8[0],
            torch.zeros(192, 656, dtype=u8),
        ],
        r"int32 \[128, 576\] is neither float rows": [torch.zeros(128, D, dtype=torch.int32)] * 2,
    }
    for why, layers in bad.items():
        with pytest.raises(CorpusBindingError, match=f"holder h9: .*{why}"):
            _resident().add_pool("h9", layers)
    meta = [torch.empty(128, 656, dtype=torch.uint8, device="meta")] * 2
    assert Resident.pool_format("h", meta) == "fp8_e4m3"  # shapes alone, nothing mapped


class _Coordinator:
    holders: ClassVar[list[Any]] = []

    def __init__(self, *a: Any, **kw: Any) -> None:
        pass

    async def __aenter__(self) -> _Coordinator:
        return self

    async def __aexit__(self, *a: Any) -> None:
        pass

    async def list_holders(self) -> list[Any]:
        return self.holders


def _shared(shape: tuple[int, ...], dtype: str) -> cuda_ipc.SharedTensor:
    return cuda_ipc.SharedTensor("GPU-0", shape, dtype, 0, b"", 0, 0, b"", 0, b"", False)


def fake_device_link(
    monkeypatch: pytest.MonkeyPatch, cfg: ModelConfig, incarnation: dict[str, str]
) -> link_mod.CorpusLink:
    """A link whose coordinator lists a holder on this GPU per key of ``incarnation`` (address
    → its process incarnation, read at each SharePool), each sharing bf16 pools of ``FRAMES``
    pages that CUDA IPC "opens" as CPU zeros."""
    holder = lambda a: SimpleNamespace(info=SimpleNamespace(address=a, device="cuda:0"))  # noqa: E731
    monkeypatch.setattr(_Coordinator, "holders", [holder(a) for a in incarnation])
    monkeypatch.setattr(catalog, "CoordinatorClient", _Coordinator)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda dev: "GPU-0")
    monkeypatch.setattr(cuda_ipc, "open_shared",
                        lambda s: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)))  # fmt: skip
    link = link_mod.CorpusLink("127.0.0.1:1", cfg, "fp", P, table_refresh_s=-1)
    layers = cfg.num_hidden_layers

    class Client:
        def __init__(self, address: str) -> None:
            self.address = address

        async def share_pool(
            self, uuid: str, peer: bool = False
        ) -> tuple[list[cuda_ipc.SharedTensor], int, int, str]:
            shared = [_shared((FRAMES * P, D), "bfloat16") for _ in range(layers)]
            return shared, P, D_V, incarnation[self.address]

    monkeypatch.setattr(link.fanout, "client", Client)
    return link


def test_map_holders_maps_fp8_pools_and_refuses_mixed_formats(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    layers = cfg.num_hidden_layers
    pools = {  # address → (page size, per-layer shape, dtype)
        "fp8-a": (P, (128, 656), "uint8"),
        "fp8-b": (P, (192, 656), "uint8"),
        "f32": (P, (128, D), "float32"),  # a float32 GPU holder: skipped, as before
        "p32": (32, (128, 656), "uint8"),  # other pages: skipped
    }
    holder = lambda a: SimpleNamespace(info=SimpleNamespace(address=a, device="cuda:0"))  # noqa: E731
    monkeypatch.setattr(_Coordinator, "holders", [holder(a) for a in pools])
    monkeypatch.setattr(catalog, "CoordinatorClient", _Coordinator)  # map_holders' client
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda dev: "GPU-0")
    opened: list[tuple[int, ...]] = []

    def open_shared(s: cuda_ipc.SharedTensor) -> torch.Tensor:
        opened.append(s.shape)
        return torch.zeros(s.shape, dtype=getattr(torch, s.dtype))

    monkeypatch.setattr(cuda_ipc, "open_shared", open_shared)
    link = link_mod.CorpusLink("127.0.0.1:1", cfg, "fp", P, table_refresh_s=-1)

    class Client:
        def __init__(self, address: str) -> None:
            self.address = address

        async def share_pool(
            self, uuid: str, peer: bool = False
        ) -> tuple[list[cuda_ipc.SharedTensor], int, int, str]:
            page, shape, dtype = pools[self.address]
            return [_shared(shape, dtype) for _ in range(layers)], page, D_V, "inc-1"

    monkeypatch.setattr(link.fanout, "client", Client)
    try:
        res = _resident(layers)
        assert link.map_holders(res, torch.device("cpu")) == ["fp8-a", "fp8-b"]
        assert res.kv_format == "fp8_e4m3" and [len(p) for p in res.pools] == [layers] * 2
        pools["bf16"] = (P, (128, D), "bfloat16")
        pools["bad"] = (P, (100, 656), "uint8")
        _Coordinator.holders = [holder("bad"), holder("bf16")]
        opened.clear()
        with pytest.raises(CorpusBindingError, match=r"holder bad: .*whole 64-row blocks"):
            link.map_holders(_resident(layers), torch.device("cpu"))
        assert opened == []  # refused from the IPC metadata, before anything was mapped
        _Coordinator.holders = [holder(a) for a in ("fp8-a", "bf16")]
        with pytest.raises(CorpusBindingError, match=r"holder bf16 holds plain rows, holders "
                           r"\['fp8-a'\] hold fp8_e4m3 rows"):  # fmt: skip
            link.map_holders(_resident(layers), torch.device("cpu"))
    finally:
        link.close()


def test_torch_index_prep_pads_and_clears_rows_outside_the_pool() -> None:
    idx = torch.tensor([[3, -1, 7, 9], [-1, -1, -1, -1], [0, 8, 2, -5]])
    got, count = prep_indices(idx, 8, 128)
    assert got.shape == (3, 1, 128) and got.dtype == torch.int32
    assert got[:, 0, :4].tolist() == [[3, -1, 7, -1], [-1] * 4, [0, -1, 2, -1]]
    assert bool((got[:, 0, 4:] == -1).all()) and count.tolist() == [2, 0, 2]


def test_formats_pair_every_combination_and_warn_on_a_mixed_one() -> None:
    assert formats.worker_format("bfloat16") == "plain" and formats.worker_format("bf16") == "plain"
    assert formats.worker_format("fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(RuntimeError, match="--kv-cache-dtype 'fp8_e5m2'"):
        formats.worker_format("fp8_e5m2")
    # SGLang 0.5.10 leaves ``auto`` unresolved for DeepseekV32ForCausalLM (an H100 run's route
    # server died of it): the checkpoint's kv quantization, else the model's dtype
    assert formats.worker_format("auto") == "plain"
    assert formats.worker_format("auto", "FP8") == "fp8_e4m3"
    assert formats.worker_format("auto", None, "torch.bfloat16") == "plain"
    with pytest.raises(RuntimeError, match="auto gives a float16 cache"):
        formats.worker_format("auto", None, "float16")
    cfg = SimpleNamespace(torch_dtype="bfloat16")
    assert formats.model_dtype("auto", cfg) == "bfloat16"
    assert formats.model_dtype("auto", SimpleNamespace(torch_dtype=torch.float32)) == "float16"
    assert formats.model_dtype("auto", object()) == "float16"
    assert formats.model_dtype("bfloat16", object()) == "bfloat16"
    assert formats.holder_format("bfloat16+fp8_e4m3") == "fp8_e4m3"
    assert formats.holder_format("bfloat16") == formats.holder_format("float32") == "plain"
    level, line = formats.pairing("fp8_e4m3", {"b": "fp8_e4m3", "a": "fp8_e4m3"})
    assert level == logging.INFO and "fp8_e4m3 rows on a, b" in line and "as stock" in line
    level, line = formats.pairing("plain", {"a": "fp8_e4m3"})
    assert level == logging.WARNING and "match neither" in line and "--kv-format plain" in line
    level, line = formats.pairing("fp8_e4m3", {"a": "plain", "b": "fp8_e4m3"})
    assert level == logging.WARNING and "fp8_e4m3 rows on b; plain rows on a" in line
    assert formats.pairing("plain", {})[0] == logging.INFO


def test_backends_the_plugin_cannot_serve_stop_the_server_at_start() -> None:
    formats.check_backends("plain", "flashmla_sparse", "flashmla_sparse")
    formats.check_backends("plain", "flashmla_sparse", "flashmla_kv")
    formats.check_backends("fp8_e4m3", "flashmla_auto", "flashmla_kv")
    formats.check_backends("fp8_e4m3", "flashmla_kv", "flashmla_kv")
    with pytest.raises(RuntimeError, match="fp8_e4m3 needs --nsa-decode-backend flashmla_kv"):
        formats.check_backends("fp8_e4m3", "flashmla_sparse", "flashmla_sparse")
    with pytest.raises(RuntimeError, match="--nsa-decode-backend fa3"):
        formats.check_backends("plain", "flashmla_sparse", "fa3")
    with pytest.raises(RuntimeError, match="--nsa-prefill-backend tilelang"):
        formats.check_backends("plain", "tilelang", "flashmla_sparse")


def test_the_bench_runs_fp8_with_flags_the_plugin_accepts() -> None:
    """tools/bench_sglang.py --kv-cache-dtype: the default flags are unchanged, and fp8_e4m3
    gives every server SGLang's fp8 cache with the backends the plugin serves it with."""
    from tools.sglang_server import SGLANG_FLAGS, sglang_flags

    assert sglang_flags() == SGLANG_FLAGS
    for kv, backend in (("bfloat16", "flashmla_sparse"), ("fp8_e4m3", "flashmla_kv")):
        flags = sglang_flags(kv)
        got = {f: flags[flags.index(f) + 1] for f in flags if f.startswith("--")}
        assert got["--kv-cache-dtype"] == kv
        assert got["--nsa-prefill-backend"] == got["--nsa-decode-backend"] == backend
        worker = formats.worker_format(kv)
        formats.check_backends(worker, got["--nsa-prefill-backend"], got["--nsa-decode-backend"])
    assert len(sglang_flags("fp8_e4m3")) == len(SGLANG_FLAGS)


def test_lse_base_says_which_log_a_kernel_returns() -> None:
    """The LSE-base probe both FlashMLA wrappers share (corpusd/kernels/flashmla.py, lse_base)."""
    from corpusd.kernels.flashmla import lse_base

    ref = torch.tensor([[2.0, 3.5], [0.25, -1.0]])
    assert lse_base(ref.clone(), ref, "k") == 1.0
    assert lse_base(ref / math.log(2.0), ref, "k") == pytest.approx(math.log(2.0))
    with pytest.raises(RuntimeError, match="FlashMLA's lse matches neither natural log nor base"):
        lse_base(ref * 3.0, ref, "FlashMLA's lse")


def test_a_corpus_on_a_restarted_holder_is_refused_not_read_from_the_old_pool(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder restarted with the same address and state serves from a new pool, while this
    server's mapping (and decode graphs) hold the old one: a corpus loaded after the restart
    would be read from the old pool's frames. The load compares the holder's incarnation with
    the mapped one and refuses, naming the holder; before the restart the same load succeeds.
    The arena is left as it was."""
    cfg = ModelConfig.from_dir(tiny_dir)
    layers = cfg.num_hidden_layers
    incarnation = {"h0": "first", "h1": "first"}
    link = fake_device_link(monkeypatch, cfg, incarnation)

    g = torch.Generator().manual_seed(SEED)

    def view(cid: str, on: int) -> CorpusView:  # 3 pages, each on holder ``on``
        reps = tuple(((on, f),) for f in (4, 9, 2))
        return CorpusView(cid, 150, P, ("h0", "h1"), torch.full((3,), on), torch.tensor([4, 9, 2]),
                          reps)  # fmt: skip

    keys = [torch.randn(150, 128, generator=g) for _ in range(layers)]

    async def corpus(cid: str) -> Any:  # the link's binding: its view and index keys
        async def index_keys(layer: int) -> torch.Tensor:
            return keys[layer]

        return SimpleNamespace(view=view(cid, 0 if cid.endswith("on-h0") else 1),
                               index_keys=index_keys)  # fmt: skip

    monkeypatch.setattr(link.catalog, "corpus", corpus)
    try:
        res = _resident(layers)
        assert link.map_holders(res, torch.device("cpu")) == ["h0", "h1"]
        binding = lambda cid: SimpleNamespace(corpus_id=cid, tokens=150)  # noqa: E731
        first = link.load_resident(binding("on-h0"), res)  # type: ignore[arg-type]
        incarnation["h1"] = "second"  # h1 restarts
        tables = (res.page_holder.clone(), res.page_frame.clone(), res._next_page)
        with pytest.raises(CorpusBindingError, match=r"holder h1 restarted after this SGLang"):
            link.load_resident(binding("on-h1"), res)  # type: ignore[arg-type]
        assert "on-h1" not in res.corpora
        assert torch.equal(res.page_holder, tables[0]) and res._next_page == tables[2]
        # h0 did not restart: its corpus stays, and another on it still loads
        assert link.load_resident(binding("on-h0"), res) is first  # type: ignore[arg-type]
        link.load_resident(binding("also-on-h0"), res)  # type: ignore[arg-type]
    finally:
        link.close()
