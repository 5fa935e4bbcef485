"""Holders on another GPU of the host, mapped by the SGLang plugin's device path over peer
access (``cuda_p2p``), on CPU: the transport rule (:func:`requester.fanout_device.device_transport`)
and ``map_holders`` with the coordinator, the holders' SharePool and CUDA IPC faked (GPU UUIDs
stand for GPUs, a visibility table for CUDA_VISIBLE_DEVICES and P2P). The GPU run of the same
mapping, a holder process on GPU 1 read from GPU 0, is ``tests/gpu/test_gpu_peer_pool.py``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from corpusd.model import ModelConfig
from corpusd.transport import cuda_ipc
from requester.corpus_view import CorpusView
from requester.fanout_device import device_transport
from requester.sglang import catalog
from requester.sglang import link as link_mod
from tests.unit.test_sglang_device_fp8 import D_V, FRAMES, D, P, _Coordinator, _resident

VISIBLE = {"GPU-0": 0, "GPU-1": 1, "GPU-2": 2}  # what this process sees, by UUID → index
PEERS = {(0, 1), (1, 0)}  # GPU 2 has no P2P with GPU 0


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ipc, "local_device", VISIBLE.get)
    monkeypatch.setattr(
        cuda_ipc, "peer_reachable",
        lambda here, uuid: uuid in VISIBLE and (here, VISIBLE[uuid]) in PEERS | {(here, here)},
    )  # fmt: skip


def test_the_transport_rule_same_gpu_peer_gpu_or_none(gpus: None) -> None:
    assert device_transport("GPU-0", "GPU-0") == "cuda_ipc"
    assert device_transport("GPU-0", "GPU-0", peer=False) == "cuda_ipc"
    assert device_transport("GPU-0", "GPU-1") == "cuda_p2p"
    assert device_transport("GPU-0", "GPU-1", peer=False) is None  # CORPUSD_SGLANG_PEER=0
    assert device_transport("GPU-0", "GPU-2") is None  # visible, no P2P
    assert device_transport("GPU-0", "GPU-other-host") is None  # not visible: another host


def test_map_holders_maps_peer_gpus_over_p2p_and_skips_unreachable_ones(
    tiny_dir: Path, gpus: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    layers = cfg.num_hidden_layers
    where = {"h-own": "GPU-0", "h-peer": "GPU-1", "h-nop2p": "GPU-2", "h-far": "GPU-9"}
    holder = lambda a: SimpleNamespace(info=SimpleNamespace(address=a, device="cuda:0"))  # noqa: E731
    monkeypatch.setattr(_Coordinator, "holders", [holder(a) for a in where])
    monkeypatch.setattr(catalog, "CoordinatorClient", _Coordinator)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda dev: "GPU-0")
    opened: list[tuple[str, int | None]] = []

    def open_shared(s: cuda_ipc.SharedTensor, on: int | None = None) -> torch.Tensor:
        opened.append((s.device_uuid, on))
        return torch.zeros(s.shape, dtype=getattr(torch, s.dtype))

    monkeypatch.setattr(cuda_ipc, "open_shared", open_shared)
    asked: dict[str, bool] = {}

    class Client:
        def __init__(self, address: str) -> None:
            self.address = address

        async def share_pool(
            self, uuid: str, peer: bool = False
        ) -> tuple[list[cuda_ipc.SharedTensor], int, int, str]:
            asked[self.address] = peer
            gpu = where[self.address]
            shared = [cuda_ipc.SharedTensor(gpu, (FRAMES * P, D), "bfloat16", 0, b"", 0, 0, b"",
                                            0, b"", False) for _ in range(layers)]  # fmt: skip
            return shared, P, D_V, f"inc-{self.address}"

    link = link_mod.CorpusLink("127.0.0.1:1", cfg, "fp", P, table_refresh_s=-1)
    monkeypatch.setattr(link.fanout, "client", Client)
    try:
        res = _resident(layers)
        with caplog.at_level("INFO", logger="corpusd.sglang"):
            assert link.map_holders(res, torch.device("cpu")) == ["h-own", "h-peer"]
        assert res.transport == {"h-own": "cuda_ipc", "h-peer": "cuda_p2p"}
        assert asked == dict.fromkeys(where, True)
        # the own GPU's pool on its own device, the peer's mapped onto this one (index 0)
        assert opened[: 2 * layers] == [("GPU-0", None)] * layers + [("GPU-1", 0)] * layers
        assert "h-nop2p not mapped" in caplog.text and "h-far not mapped" in caplog.text
        view = CorpusView("c", 3 * P, P, ("h-own", "h-peer"), torch.zeros(3, dtype=torch.long),
                          torch.tensor([0, 1, 2]), (((0, 1),), ((1, 4),), ((1, 5),)))  # fmt: skip
        plan = res.plan(view)
        assert {g.address: g.transport for g in plan.groups} == {
            "h-own": "cuda_ipc",
            "h-peer": "cuda_p2p",
        }
        # without peer access only the own GPU's holder is mapped
        asked.clear()
        alone = _resident(layers)
        assert link.map_holders(alone, torch.device("cpu"), peer=False) == ["h-own"]
        assert set(asked.values()) == {False}
    finally:
        link.close()
