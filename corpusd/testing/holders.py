"""Corpora and holders to test against: a real pin of a small text (``pin_sample``), a
synthetic corpus committed without a prefill (``synthetic_corpus``), and real ``corpusd holder``
processes on loopback, one (``start_holder``) or several registering with a coordinator
(``start_holders``)."""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from corpusd.corpus.manifest import Manifest, corpus_id
from corpusd.corpus.pin import PinConfig, pin
from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig, fingerprint
from corpusd.tokenizer import load_tokenizer
from holder.launch import HolderProcess
from holder.launch import start_holder as _start


def text_tar(path: Path, body: str, name: str = "src/main.txt") -> Path:
    """A tar at ``path`` holding one text file ``name`` with ``body``; returns ``path``."""
    data = body.encode()
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def pin_sample(
    tmp: Path, model_dir: Path, tokens: int = 1000, dtype: str = "float32", kv_format: str = "plain"
) -> str:
    """Pin ~``tokens`` tokens (in the model's own tokenizer: bytes, or the CPU default's BPE)
    of text into ``tmp/store`` (cache in ``dtype``, latent rows in ``kv_format``); returns the
    corpus id."""
    cfg = ModelConfig.from_dir(model_dir)
    tok = load_tokenizer(model_dir, cfg.bos_token_id, cfg.eos_token_id)
    lines = (f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(1 << 30))
    body, count = "", 0
    while count < tokens:  # one line's tokens, as the file's own stream counts them
        line = next(lines)
        body += line
        count += len(tok.encode(line))
    body = body[: len(body) * tokens // count]
    src = text_tar(tmp / "repo.tar", body)
    r = pin(
        PinConfig(
            corpus=str(src),
            model=str(model_dir),
            store=str(tmp / "store"),
            dtype=dtype,
            kv_format=kv_format,
        ),
        io.StringIO(),
    )
    return r.manifest.corpus_id


def start_holder(
    store: Path, state_dir: Path, model_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> HolderProcess:
    return _start(store, state_dir, model_dir, "--threads", "1", *extra, env=env)


def synthetic_corpus(
    store: Path, model_dir: Path, tokens: int, seed: int = 0, name: str = ""
) -> str:
    """A corpus of ``tokens`` random tokens with random latent rows, committed to ``store`` like a
    real pin (same manifest, files and checksums) but without the prefill: placement and holders
    only read pages, and a few seconds of prefill per corpus would dominate these tests. ``name``
    defaults to ``synthetic-<tokens>-<seed>``."""
    cfg = ModelConfig.from_dir(model_dir)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 256, (tokens,), generator=g)
    fp = fingerprint(model_dir)
    cid = corpus_id(tuple(toks.tolist()), fp, 64, "float32")
    m = Manifest(
        corpus_id=cid, name=name or f"synthetic-{tokens}-{seed}", state="ready", source_kind="test",
        source_digest="sha256:" + "0" * 64, token_count=tokens, page_size=64,
        n_pages=-(-tokens // 64), n_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim,
        index_dim=cfg.index_head_dim, dtype="float32", model_fingerprint=fp, tokenizer="bytes",
    )  # fmt: skip
    ps = PageStore(store)
    if ps.has(cid):
        return cid
    with ps.writer(cid) as w:
        w.write_tokens(toks)
        for layer in range(cfg.num_hidden_layers):
            lat = torch.randn(tokens, cfg.kv_dim, generator=g)
            w.write_layer(layer, lat, torch.randn(tokens, cfg.index_head_dim, generator=g), 64)
        w.write_manifest(replace(m, checksums=dict(w.checksums)))
    return cid


def start_holders(
    store: Path, root: Path, model: Path, coordinator: str, n: int, *extra: str
) -> list[HolderProcess]:
    """``n`` holders ``root/h0…`` registering with ``coordinator``, started in parallel."""
    with ThreadPoolExecutor(n) as ex:
        return list(
            ex.map(
                lambda i: start_holder(
                    store, root / f"h{i}", model, "--coordinator", coordinator, *extra
                ),
                range(n),
            )
        )
