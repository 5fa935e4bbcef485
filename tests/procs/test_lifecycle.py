"""A corpus's lifecycle through the CLI against a real coordinator and two real holders:
``ls`` and ``status`` (tables and JSON), ``unpin`` (off every holder, out of the page table;
``--delete`` out of the store too), ``rm`` (refused while pinned), and bad input that answers
one line, exit code 2, and changes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.testing.holders import start_holders, synthetic_corpus
from holder.launch import HolderProcess
from requester.holder_client import HolderClient


@dataclass
class Cluster:
    co: CoordinatorProcess
    holders: list[HolderProcess]
    store: Path
    ids: dict[str, str]  # name → corpus id


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    """Two holders of 16 frames; "alpha" (5 pages × 2 replicas), "beta" (4 pages) and two
    corpora both named "twin" pinned; "loose" only stored (never published)."""
    tmp = tmp_path_factory.mktemp("lifecycle")
    store = tmp / "store"
    ids = {
        "alpha": synthetic_corpus(store, tiny_dir, 300, seed=1, name="alpha"),
        "beta": synthetic_corpus(store, tiny_dir, 200, seed=2, name="beta"),
        "twin1": synthetic_corpus(store, tiny_dir, 100, seed=3, name="twin"),
        "twin2": synthetic_corpus(store, tiny_dir, 100, seed=4, name="twin"),
        "loose": synthetic_corpus(store, tiny_dir, 100, seed=5, name="loose"),
    }
    co = start_coordinator(tmp / "coord", store)
    hs = start_holders(store, tmp, tiny_dir, co.address, 2, "--capacity-tokens", "1024")

    async def publish() -> None:
        async with CoordinatorClient(co.address) as c:
            await c.wait_holders(2)
            await c.pin(ids["alpha"], replicas=2)
            for key in ("beta", "twin1", "twin2"):
                await c.pin(ids[key])

    asyncio.run(publish())
    yield Cluster(co, hs, store, ids)
    assert [h.stop() for h in hs] == [0, 0]
    assert co.stop() == 0


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli_main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def ls(cl: Cluster, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    """``ls --json`` by corpus id, without the ages (they move)."""
    rc, out, err = run(capsys, "ls", "--json", "--coordinator", cl.co.address)
    assert rc == 0 and err == "", err
    return {
        c["corpus_id"]: {k: v for k, v in c.items() if k != "state_age_s"} for c in json.loads(out)
    }


def held(cl: Cluster) -> dict[str, set[str]]:
    """corpus id → holder addresses that hold frames of it (their Info)."""

    async def ask() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for h in cl.holders:
            hc = HolderClient(h.address)
            for c in (await hc.info()).corpora:
                if c.frames:
                    out.setdefault(c.corpus_id, set()).add(h.address)
            await hc.close()
        return out

    return asyncio.run(ask())


def test_ls_and_status_list_every_corpus_as_a_table_and_as_json(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = cluster.ids
    rc, out, _ = run(capsys, "ls", "--coordinator", cluster.co.address)
    lines = out.splitlines()
    assert rc == 0 and lines[0] == f"coordinator {cluster.co.address}", out
    assert lines[1].split() == ["NAME", "ID", "TOKENS", "REPLICAS", "HOLDERS", "STATE", "AGE"]
    alpha = next(line for line in lines if line.startswith("alpha "))
    cells = alpha.split()
    assert cells[:4] == ["alpha", ids["alpha"][:12], "300", "2"] and cells[5] == "ready", alpha
    assert len(cells[4].split(",")) == 2 and cells[-1] == "s", alpha  # both holders; "N s"
    loose = next(line for line in lines if line.startswith("loose "))
    assert loose.split()[3:6] == ["-", "-", "stored"], loose

    listed = ls(cluster, capsys)
    assert set(listed) == set(ids.values())
    a = listed[ids["alpha"]]
    assert (a["name"], a["state"], a["tokens"], a["pages"], a["replicas"]) == (
        "alpha", "ready", 300, 5, 2,
    )  # fmt: skip
    assert len(a["holder_ids"]) == 2 and "created_at" in a  # type: ignore[arg-type]
    assert listed[ids["loose"]]["state"] == "stored"

    rc, out, _ = run(capsys, "status", "--json", "--coordinator", cluster.co.address)
    st = json.loads(out)
    assert rc == 0 and set(st) == {"coordinator", "holders", "corpora", "workers"}
    assert st["coordinator"] == cluster.co.address and len(st["holders"]) == 2
    assert all(h["info"]["live"] for h in st["holders"]) and st["workers"] == []
    assert {c["corpus_id"] for c in st["corpora"]} == {
        ids[k] for k in ("alpha", "beta", "twin1", "twin2")
    }


def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    addr, ids = cluster.co.address, cluster.ids
    before, frames = ls(cluster, capsys), held(cluster)
    cases = [
        (["unpin", "", "--coordinator", addr], "INVALID_ARGUMENT: no corpus given"),
        (["unpin", "nosuch", "--coordinator", addr], "NOT_FOUND: corpus 'nosuch' is not known"),
        (["unpin", ids["alpha"][:7], "--coordinator", addr], "is not known"),  # prefix < 8
        (["unpin", "twin", "--coordinator", addr], "INVALID_ARGUMENT: corpus 'twin' is ambiguous"),
        (["unpin", "loose", "--coordinator", addr], "is not known"),  # stored, never pinned
        (["rm", "alpha", "--coordinator", addr], "FAILED_PRECONDITION: corpus alpha ("),
        (["rm", ids["beta"][:8], "--coordinator", addr], "is ready on "),
        (["rm", "twin", "--coordinator", addr], "ambiguous"),
        (["rm", "nosuch", "--coordinator", addr], "NOT_FOUND"),
    ]
    for args, want in cases:
        rc, out, err = run(capsys, *args)
        assert rc == 2 and out == "" and err.count("\n") == 1 and want in err, (args, err)
        assert err.startswith("corpusd: error: "), err
    rc, _, err = run(capsys, "rm", "alpha", "--coordinator", addr)
    assert "unpin it first" in err and "holder" in err, err
    monkeypatch.delenv("CORPUSD_COORDINATOR", raising=False)
    monkeypatch.setenv("CORPUSD_HOME", str(tmp_path / "home"))
    rc, _, err = run(capsys, "unpin", "alpha")
    assert rc == 2 and err.startswith("corpusd: error: no coordinator:") and err.count("\n") == 1
    assert ls(cluster, capsys) == before and held(cluster) == frames
    assert all(PageStore(cluster.store).has(i) for i in ids.values())


def test_unpin_releases_everywhere_then_rm_deletes(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    addr, ids, store = cluster.co.address, cluster.ids, PageStore(cluster.store)
    alpha, beta = ids["alpha"], ids["beta"]
    assert len(held(cluster)[alpha]) == 2

    rc, out, err = run(capsys, "unpin", "alpha", "--coordinator", addr)
    assert rc == 0 and err == "", err
    assert out.startswith(f"unpinned alpha (corpus {alpha}): released 10 frames on "), out
    assert alpha not in held(cluster) and beta in held(cluster)  # the holders dropped its frames
    listed = ls(cluster, capsys)
    assert listed[alpha]["state"] == "retired" and listed[alpha]["holder_ids"] == []
    assert listed[beta]["state"] == "ready" and store.has(alpha)  # still stored

    rc, out, err = run(capsys, "unpin", "alpha", "--coordinator", addr)  # again: nothing to do
    assert rc == 2 and "is not pinned: it was unpinned earlier; nothing changed" in err, err
    assert "corpusd rm alpha" in err and ls(cluster, capsys) == listed

    rc, out, err = run(capsys, "rm", "alpha", "--coordinator", addr)
    assert rc == 0 and out.startswith(f"deleted alpha (corpus {alpha}) from the page store"), out
    assert not store.has(alpha) and alpha not in ls(cluster, capsys)
    assert not any(store.tmp.iterdir())  # the rename's temp directory is gone too

    # the pinned one of two same-named corpora is the one unpin means; --delete by id prefix
    rc, out, err = run(capsys, "unpin", "--delete", beta[:8], "--coordinator", addr)
    assert rc == 0 and out.startswith(f"unpinned beta (corpus {beta}): released 4 frames"), out
    assert "; deleted it from the page store (" in out
    assert beta not in held(cluster) and not store.has(beta) and beta not in ls(cluster, capsys)

    rc, out, err = run(capsys, "rm", "loose", "--coordinator", addr)  # never pinned: deletable
    assert rc == 0 and "deleted loose" in out and not store.has(ids["loose"]), err


def test_ls_and_rm_without_a_coordinator_use_the_local_store(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("CORPUSD_COORDINATOR", raising=False)
    monkeypatch.setenv("CORPUSD_HOME", str(tmp_path / "home"))
    store = tmp_path / "store"
    cid = synthetic_corpus(store, tiny_dir, 100, seed=9, name="solo")
    rc, out, _ = run(capsys, "ls", "--store", str(store))
    assert rc == 0 and out.startswith(f"page store {store} (no coordinator: "), out
    assert out.splitlines()[2].split()[:3] == ["solo", cid[:12], "100"], out
    rc, out, _ = run(capsys, "ls", "--json", "--store", str(store))
    assert [c["corpus_id"] for c in json.loads(out)] == [cid]
    rc, _, err = run(capsys, "rm", "nosuch", "--store", str(store))
    assert rc == 2 and "no corpus named or with id 'nosuch'" in err and err.count("\n") == 1
    rc, out, _ = run(capsys, "rm", "solo", "--store", str(store))
    assert rc == 0 and out.startswith(f"deleted solo (corpus {cid}) from {store}"), out
    assert not PageStore(store).has(cid)
    rc, out, _ = run(capsys, "ls", "--json", "--store", str(tmp_path / "none"))
    assert rc == 0 and json.loads(out) == []
