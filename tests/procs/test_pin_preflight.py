"""`corpusd pin` against a real coordinator and real holders: what the coordinator would refuse
is refused before the prefill (nothing written, one line, exit 2), and a pin that fits is
published."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.model.tiny import init_tiny
from corpusd.testing.holders import start_holders


@pytest.fixture(scope="module")
def tiny_dir(sglang_dir: Path) -> Path:
    """This module sizes its corpora in byte tokens and needs V3.2's 64 × 128 indexer (fp8 index
    arithmetic quantizes 128-wide keys): the sglang preset, not the CPU default."""
    return sglang_dir


def _tar(path: Path, tokens: int) -> Path:
    data = ("".join(f"line {i}: the quick brown fox\n" for i in range(tokens)))[:tokens].encode()
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("src/main.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[tuple[str, Path]]:
    """A coordinator and two holders of 16 frames (1,024 tokens) each over an empty store."""
    tmp = tmp_path_factory.mktemp("pin-preflight")
    store = tmp / "store"
    co: CoordinatorProcess = start_coordinator(tmp / "coord", store)
    hs = start_holders(store, tmp, tiny_dir, co.address, 2, "--capacity-tokens", "1024")

    async def wait() -> None:
        async with CoordinatorClient(co.address) as c:
            await c.wait_holders(2)

    asyncio.run(wait())
    yield co.address, store
    assert [h.stop() for h in hs] == [0, 0]
    assert co.stop() == 0


def _refused(capsys: pytest.CaptureFixture[str], store: Path, args: list[str]) -> str:
    before = sorted((store / "corpora").glob("*")) if (store / "corpora").exists() else []
    assert cli_main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith("corpusd: error: coordinator: ") and err.count("\n") == 1, err
    assert "nothing was pinned" in err and "prefill" not in err and "pinned:" not in out
    after = sorted((store / "corpora").glob("*")) if (store / "corpora").exists() else []
    assert after == before
    return err


@pytest.mark.parametrize("case", ["replicas", "fingerprint", "capacity"])
def test_a_pin_the_coordinator_would_refuse_is_refused_before_the_prefill(
    case: str,
    cluster: tuple[str, Path],
    tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, store = cluster
    model, tokens, extra = tiny_dir, 600, []
    if case == "replicas":
        extra, want = ["--replicas", "3"], "replicas 3 > 2 live holders"
    elif case == "fingerprint":
        model = tmp_path / "other-model"
        init_tiny(model, seed=1)  # same shapes, other weights: another fingerprint
        want = "0 of 2 live holders can load this pin (model sha256:"
    else:
        tokens = 2100  # 34 pages (with BOS and the file header) > 2 × 16 frames
        want = "exceed the live holders' capacity (32 frames on 2 holders)"
    src = _tar(tmp_path / "repo.tar", tokens)
    args = ["pin", "--corpus", str(src), "--store", str(store), "--model", str(model)]
    err = _refused(capsys, store, [*args, "--coordinator", address, *extra])
    assert want in err


def test_a_pin_that_fits_is_estimated_and_published(
    cluster: tuple[str, Path], tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, store = cluster
    src = _tar(tmp_path / "repo.tar", 300)
    args = ["pin", "--corpus", str(src), "--store", str(store), "--model", str(tiny_dir)]
    assert cli_main([*args, "--coordinator", address, "--replicas", "2"]) == 0
    out, err = capsys.readouterr()
    assert "prefill of " in err and "bench/results/pin-cpu.json" in err
    assert "pinned: repo" in out and f"published via {address}" in out and "× 2" in out
