"""``corpusd pin --kv-format fp8_e4m3``: the stored rows are the quantized prefill, the format is
in the manifest and the corpus id, and a model whose latent row does not fit is refused in one
line with nothing written."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.corpus import pin as pin_mod
from corpusd.corpus.manifest import Manifest
from corpusd.corpus.pin import torch_threads
from corpusd.corpus.store import PageStore
from corpusd.kernels import fp8_cache as f8
from corpusd.model import KVCache, forward_tokens
from corpusd.model.tiny import init_tiny


def _tar(path: Path) -> Path:
    data = "".join(f"row {i}: {i * 7919 % 1013}\n" for i in range(12)).encode()  # ~2 pages
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("src/a.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_fp8_pin_stores_the_quantized_prefill(
    tmp_path: Path, tiny_dir: Path, tiny_model, capsys, monkeypatch, load: str
) -> None:  # type: ignore[no-untyped-def]
    """Bit for bit at the pin's thread count. The pin picks its count by the cores busy now (a
    busy machine, as in a full test run, gets 1 thread); a forward at another count rounds its
    reductions differently, which is how this test once failed only in the full suite."""
    busy = (os.cpu_count() or 1) - 1 if load == "busy" else 0
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(pin_mod, "busy_cores", lambda: float(busy))
    src, store_dir = _tar(tmp_path / "repo.tar"), tmp_path / "store"
    base = ["pin", "--corpus", str(src), "--model", str(tiny_dir), "--store", str(store_dir)]
    before = torch.get_num_threads()
    # one prefill chunk: the same arithmetic as the monolithic forward below
    assert cli_main([*base, "--kv-format", "fp8_e4m3", "--chunk", "4096"]) == 0
    assert torch.get_num_threads() == before, "the pin left its thread count behind"
    out, err = capsys.readouterr()
    assert "float32+fp8_e4m3" in out and "as fp8 rows" in out, out
    threads = int(re.search(r"on (\d+) of \d+ CPU threads", err)[1])  # type: ignore[index]
    assert threads == (1 if load == "busy" else os.cpu_count()), err
    store = PageStore(store_dir)
    (cid,) = store.ids()
    m = store.manifest(cid)
    assert m.kv_format == "fp8_e4m3" and m.dtype == "float32"
    tokens = store.read_tokens(cid).long()
    cache = KVCache(tiny_model.cfg, m.token_count, torch.float32)
    with torch_threads(threads):
        forward_tokens(tiny_model, tokens, cache, want_logits=False)
    for layer in range(m.n_layers):
        lat, keys = store.read_pages(cid, layer, list(range(m.n_pages)))
        lat = lat.reshape(-1, 656)
        want = f8.quantize(cache.latent[layer][: m.token_count])
        assert torch.equal(lat[: m.token_count], want), f"{layer=}: stored rows ≠ quantized prefill"
        assert bool((lat[m.token_count :] == 0).all())  # padding rows: zero tiles, zero scales
        flat = keys.reshape(-1, m.index_dim)[: m.token_count]
        assert torch.equal(flat, cache.index_keys[layer][: m.token_count])  # keys stay float32
    store.verify(cid)


def test_a_model_whose_row_does_not_fit_is_refused(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = init_tiny(tmp_path / "narrow", kv_lora_rank=256)
    src, store_dir = _tar(tmp_path / "repo.tar"), tmp_path / "store"
    args = ["pin", "--corpus", str(src), "--model", str(model), "--store", str(store_dir)]
    assert cli_main([*args, "--kv-format", "fp8_e4m3"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "needs kv_lora_rank 512" in err and "has kv_lora_rank 256" in err
    )
    assert not store_dir.exists() or PageStore(store_dir).ids() == []


def test_manifest_kv_format_default_and_refusal() -> None:
    m = Manifest(
        corpus_id="ab" * 16,
        name="x",
        state="ready",
        source_kind="tar",
        source_digest="sha256:0",
        token_count=65,
        page_size=64,
        n_pages=2,
        n_layers=2,
        kv_dim=576,
        index_dim=128,
        dtype="bfloat16",
        model_fingerprint="fp",
        tokenizer="bytes",
        kv_format="fp8_e4m3",
    )
    assert (m.page_format, m.latent_width, m.latent_dtype) == (
        "bfloat16+fp8_e4m3",
        656,
        torch.uint8,
    )
    assert m.token_layer_bytes == 656 + 128 * 2
    d = json.loads(m.to_json())
    del d["kv_format"]  # written before formats existed: plain rows
    old = Manifest.from_json(json.dumps(d))
    assert (old.kv_format, old.page_format, old.latent_width) == ("plain", "bfloat16", 576)
    with pytest.raises(ValueError, match="kv_format"):
        Manifest.from_json(json.dumps({**d, "kv_format": "fp4"}))


def test_up_in_the_background_keeps_the_holders_format(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``corpusd up --detach 1`` re-runs itself in the background: the flags it passes on include
    ``--kv-format`` (it once dropped it, so fp8 pins found only plain holders)."""
    import corpusd.up as up_mod

    seen: list[list[str]] = []

    class Stop(Exception):
        pass

    def popen(args: list[str], **_: object) -> None:
        seen.append(args)
        raise Stop

    monkeypatch.setattr(up_mod.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        up_mod._detach(up_mod.UpConfig(kv_format="fp8_e4m3", detach=1), tmp_path)
    (args,) = seen
    assert args[args.index("--kv-format") + 1] == "fp8_e4m3", args
