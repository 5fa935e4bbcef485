"""``corpusd pin --engine`` against a stand-in SGLang server on loopback (no sglang, no GPU).

Bad input — an unreachable server, one without the capture backend, one serving another model, a
spool this process cannot read, pages that never come — exits 2 with one line and leaves the page
store as it was. The happy path runs the real capture backend (``CorpusdHiCacheStorage`` in
capture mode) over a host pool shaped as SGLang's, fed by corpusd's own bf16 prefill: the stored
corpus then equals a normal bf16 pin bit for bit, and the fetch path serves the pages back exactly
as the engine's host pool held them.
"""

from __future__ import annotations

import io
import socket
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.corpus.store import PageStore
from corpusd.engine import spool
from corpusd.model import ModelConfig, fingerprint
from requester.sglang.pagehash import index_k_from_page, index_k_page, page_hashes
from requester.sglang.pages import CorpusPages, engine_index_keys
from tests.support.engine_server import CaptureEngine, StandInEngine, server_info
from tests.support.sglang_host import load_hicache

P = 64


@pytest.fixture(scope="module")
def model(sglang_dir: Path) -> Path:
    """Byte tokens (the corpus's length is exact) and V3.2's 128-wide index keys."""
    return sglang_dir


def _tar(path: Path, n_bytes: int) -> Path:
    text = "".join(f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(400))
    data = text.encode()[:n_bytes]
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("src/main.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def me_tokens(store: Path) -> int:
    (cid,) = PageStore(store).ids()
    return PageStore(store).manifest(cid).token_count


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    s = tmp_path / "store"
    PageStore(s)
    return s


@pytest.fixture
def engine_spool(tmp_path: Path, model: Path) -> Iterator[tuple[StandInEngine, Path]]:
    """A stand-in with the capture backend configured and a spool that reports ``model``'s
    fingerprint, but no prefill behind ``/generate``."""
    sp = tmp_path / "spool"
    sp.mkdir()
    e = StandInEngine(server_info(sp, model))
    yield e, sp
    e.close()


def _pin(store: Path, model: Path, src: Path, url: str, *extra: str) -> int:
    args = ["pin", "--corpus", str(src), "--model", str(model), "--store", str(store)]
    return cli_main([*args, "--engine", url, "--coordinator", "", *extra])


def _refused(
    capsys: pytest.CaptureFixture[str], store: Path, before: dict[str, int], rc: int, *words: str
) -> str:
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after any progress lines
    assert rc == 2, err
    assert err.startswith("corpusd: error: "), err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    assert _listing(store) == before, "a refused engine pin changed the page store"
    return err


def test_an_unreachable_engine_is_named_with_its_cause(
    tmp_path: Path, store: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    before = _listing(store)
    url = f"http://127.0.0.1:{port}"
    rc = _pin(store, model, _tar(tmp_path / "r.tar", 300), url)
    _refused(capsys, store, before, rc, f"engine {url} is unreachable", "refused")
    rc = _pin(store, model, _tar(tmp_path / "r.tar", 300), "grpc://127.0.0.1:1")
    _refused(capsys, store, before, rc, "want http://HOST:PORT")


def test_an_engine_without_the_capture_backend_is_told_the_flags(
    tmp_path: Path, store: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    e = StandInEngine(server_info(None, model))
    try:
        before = _listing(store)
        rc = _pin(store, model, _tar(tmp_path / "r.tar", 300), e.url)
        err = _refused(capsys, store, before, rc, "lacks the corpusd capture backend")
        for flag in ("--enable-hierarchical-cache", "--hicache-write-policy write_through",
                     "--hicache-storage-backend dynamic", '"corpusd_capture"',
                     '"module_path": "requester.sglang.hicache"'):  # fmt: skip
            assert flag in err, flag
        assert e.calls == ["GET /server_info"], "it went on past the preflight"
    finally:
        e.close()


def test_an_engine_serving_another_model_is_refused(
    tmp_path: Path,
    store: Path,
    model: Path,
    engine_spool: tuple[StandInEngine, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    e, sp = engine_spool
    other = "sha256:" + "0" * 64
    spool.EngineInfo(other, "/models/other", P, "layer_first", "bfloat16", 576, 2, True).write(sp)
    before = _listing(store)
    rc = _pin(store, model, _tar(tmp_path / "r.tar", 300), e.url)
    _refused(capsys, store, before, rc, "serves /models/other", "sha256:000000000000", str(model))
    assert e.calls == ["GET /server_info"]


def test_a_model_whose_index_keys_sglang_cannot_hold_is_refused(
    tmp_path: Path, store: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sp = tmp_path / "spool"
    sp.mkdir()
    e = StandInEngine(server_info(sp, tiny_dir))  # the CPU preset: 64-wide index keys
    try:
        spool.EngineInfo(fingerprint(tiny_dir), str(tiny_dir), P, "layer_first", "bfloat16", 576,
                         2, True).write(sp)  # fmt: skip
        before = _listing(store)
        rc = _pin(store, tiny_dir, _tar(tmp_path / "r.tar", 300), e.url)
        _refused(capsys, store, before, rc, "64-wide index keys", "--preset sglang")
    finally:
        e.close()


def test_a_spool_this_process_cannot_read_is_refused(
    tmp_path: Path,
    store: Path,
    model: Path,
    engine_spool: tuple[StandInEngine, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    e, sp = engine_spool  # the backend never wrote engine.json there
    before = _listing(store)
    rc = _pin(store, model, _tar(tmp_path / "r.tar", 300), e.url)
    _refused(capsys, store, before, rc, f"captures into {sp}", "cannot read")


def test_pages_that_never_reach_the_spool_time_out_with_nothing_stored(
    tmp_path: Path,
    store: Path,
    model: Path,
    engine_spool: tuple[StandInEngine, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    e, sp = engine_spool
    n_layers = ModelConfig.from_dir(model).num_hidden_layers
    spool.EngineInfo(fingerprint(model), str(model), P, "layer_first", "bfloat16", 576, n_layers,
                     True).write(sp)  # fmt: skip
    e.on_generate = lambda ids, n: [7] * n  # answers, captures nothing (no write_through)
    before = _listing(store)
    rc = _pin(store, model, _tar(tmp_path / "r.tar", 300), e.url, "--engine-timeout", "1")
    _refused(capsys, store, before, rc, "pages did not reach its spool", "write_through")
    assert "POST /generate" in e.calls


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_engine_pages_are_a_normal_pins_and_are_served_back_as_the_engine_held_them(
    tmp_path: Path,
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kv_dtype: str,
) -> None:
    # Both pins prefill through corpus.pin.prefill, whose thread count follows the load
    # average; equal bits need equal counts, so both take this process's (OMP_NUM_THREADS wins).
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    src = _tar(tmp_path / "r.tar", 3 * P + 5)  # + header and BOS: a partial last page
    eng = CaptureEngine(load_hicache(monkeypatch), tmp_path / "spool", model, kv_dtype)
    try:
        st_e = tmp_path / "engine-store"
        assert _pin(st_e, model, src, eng.url, "--name", "eng") == 0
        out = capsys.readouterr().out
        assert "engine    sglang-0.5.10.post1 at " + eng.url in out, out
        assert eng.prefills == [me_tokens(st_e)], "the prefill was not of the corpus alone"
        assert _pin(st_e, model, src, eng.url, "--name", "eng") == 0  # the same pin again
        assert "already pinned" in capsys.readouterr().out and len(eng.prefills) == 1
        # capture mode serves nothing: SGLang computes every page
        whole = page_hashes(PageStore(st_e).read_tokens(PageStore(st_e).ids()[0]).tolist(), P)
        assert eng.backend.batch_exists(whole) == 0 and not eng.backend.exists(whole[0])
        assert _pin(st_e, model, src, eng.url, "--name", "other") == 2
        assert "already pinned through sglang-0.5.10.post1 as 'eng'" in capsys.readouterr().err
    finally:
        eng.close()
    st_n = tmp_path / "normal-store"
    fmt = ["--kv-format", kv_dtype if kv_dtype == "fp8_e4m3" else "plain"]
    args = ["pin", "--corpus", str(src), "--model", str(model), "--store", str(st_n)]
    assert cli_main([*args, "--dtype", "bfloat16", "--coordinator", "", *fmt]) == 0
    se, sn = PageStore(st_e), PageStore(st_n)
    (ce,), (cn,) = se.ids(), sn.ids()
    me, mn = se.manifest(ce), sn.manifest(cn)
    assert ce != cn, "the engine marker is not in the corpus id"
    assert me.engine["marker"] == "sglang-0.5.10.post1" and me.engine["kv_dtype"] == kv_dtype
    assert (me.model_fingerprint, me.page_format, me.token_count) == (
        mn.model_fingerprint, mn.page_format, mn.token_count,
    )  # fmt: skip
    assert me.token_count % P, "the test wants a partial last page"
    pages = list(range(me.n_pages))
    lat_e, key_e = se.read_checked(me, pages)
    lat_n, key_n = sn.read_checked(mn, pages)
    for li in range(me.n_layers):
        assert torch.equal(lat_e[li], lat_n[li]), f"layer {li}: latent rows differ"
        verbatim = se.read_index_pages(ce, li, pages)
        assert verbatim is not None
        whole = me.token_count // P
        for pg in range(whole):
            assert torch.equal(verbatim[pg], index_k_page(key_n[li][pg])), f"{li=} {pg=}"
        err = (key_e[li].float() - key_n[li].float()).norm() / key_n[li].float().norm()
        assert float(err) < 0.08, f"layer {li}: float keys {float(err)=}"
    # Route's corpus top-k (plugin with the store at hand) scores the engine's own keys: for each
    # whole page, the values SGLang's indexer reads from the page its pool held.
    assert engine_index_keys(sn, cn, 0) is None  # corpusd's own pin: its float keys are used
    keys_seen = [engine_index_keys(se, ce, li) for li in range(me.n_layers)]
    tokens = se.read_tokens(ce).tolist()
    # The fetch path serves each whole page as the engine's host pool held it, byte for byte.
    served = CorpusPages(st_e, me.model_fingerprint)
    for i, key in enumerate(page_hashes(tokens, P)):
        kv, index = served.host_page(key, "layer_first", eng.host.dtype)
        held_kv, held_index = spool.host_page(eng.host, ((3 * i + 1) % eng.host.page_num) * P)
        assert torch.equal(kv, held_kv.flatten()), f"page {i}: kv bytes differ"
        assert held_index is not None
        assert all(torch.equal(a, b) for a, b in zip(index, held_index, strict=True)), i
        for li, seen in enumerate(keys_seen):
            assert seen is not None and seen.shape == (me.token_count, 128)
            want = index_k_from_page(held_index[li])
            assert torch.equal(seen[i * P : i * P + P], want), f"{li=} page {i}"
