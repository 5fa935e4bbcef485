"""``corpusd pin --engine URL``: an SGLang server prefills the corpus; its pages are stored.

Steps: :func:`check_engine` (before anything is tokenized or written: the server is reachable,
runs the capture backend, serves the checkpoint this pin names, with a page size and kv dtype the
store takes), then :func:`pin_engine`: tokenize with corpusd's tokenizer, ``POST /generate`` the
tokens, wait until every page's hash is in the capture spool, convert the pages to corpusd's
layout and write the corpus through the store's atomic writer. Any error leaves the store as it
was.

Whole pages: SGLang's radix cache keeps (and HiCache backs up) only whole pages of the KV it
committed (``radix_cache.cache_finished_req``: ``page_align_keys`` over ``kv_committed_len`` =
prompt + generated − 1). So the request generates ``(−T mod P) + 1`` tokens greedily with
``ignore_eos``: the prefill is of exactly the corpus's ``T`` tokens (as for any prompt that is
the corpus), and the decode steps fill the last page. The rows past ``T`` are the generated
tokens', dropped (stored as zero, as any pin's tail); the last page's key is known once the
answer names its tokens. Padding the prompt with filler tokens instead would be causally right
too, but it changes the prefill's length, and kernels whose reductions depend on it (dense
attention's masked tail) round rows before ``T`` differently from a prefill of the corpus alone.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import torch

from corpusd import env
from corpusd.corpus.config import PinConfig
from corpusd.corpus.ingest import CorpusError
from corpusd.corpus.manifest import Manifest, corpus_id, page_format
from corpusd.corpus.names import default_name
from corpusd.corpus.pin import PinResult, default_model, tokenize
from corpusd.corpus.store import PageStore
from corpusd.engine.client import Engine, EngineError, preflight
from corpusd.engine.spool import (
    INDEX_DIM,
    INDEX_TOKEN_BYTES,
    KV_DTYPES,
    EngineInfo,
    corpusd_rows,
    index_page_keys,
    page_hashes,
    page_path,
    read_page,
)
from corpusd.kernels.formats import FP8, ROW_BYTES
from corpusd.model import ModelConfig, fingerprint
from corpusd.progress import Progress


@dataclass(frozen=True, slots=True)
class EngineCheck:
    """A server that passed :func:`check_engine`, and what its pages will be stored as."""

    engine: Engine
    info: EngineInfo
    spool: Path
    version: str
    model_dir: Path
    model_cfg: ModelConfig
    fingerprint: str
    dtype: str
    kv_format: str

    @property
    def marker(self) -> str:
        return f"sglang-{self.version}"


def check_engine(cfg: PinConfig, stream: TextIO | None = None) -> EngineCheck:
    """Raises EngineError (one line) unless ``cfg.engine`` can make this pin's pages."""
    assert cfg.engine, "check_engine needs cfg.engine"
    engine = Engine(cfg.engine)
    server, info, spool = preflight(engine)
    model_dir = Path(cfg.model) if cfg.model else default_model(stream or sys.stderr)
    model_cfg = ModelConfig.from_dir(model_dir)
    fp = fingerprint(model_dir)
    where = f"engine {cfg.engine}"
    if info.model_fingerprint != fp:
        raise EngineError(
            f"{where} serves {info.model_path} (fingerprint {info.model_fingerprint[:19]}…), "
            f"this pin's model {model_dir} is {fp[:19]}…: pass --model the checkpoint the "
            f"server loaded"
        )
    if info.kv_dtype not in KV_DTYPES:
        raise EngineError(
            f"{where} holds {info.kv_dtype} KV rows; the store takes {sorted(KV_DTYPES)} "
            f"(start it with --kv-cache-dtype auto on a bf16 model, or fp8_e4m3)"
        )
    dtype, kv_format = KV_DTYPES[info.kv_dtype]
    want_dim = ROW_BYTES if kv_format == FP8 else model_cfg.kv_dim
    if info.page_size != cfg.page_size:
        raise EngineError(f"{where} has page size {info.page_size}: pass --page-size "
                          f"{info.page_size} (this pin asked for {cfg.page_size})")  # fmt: skip
    if model_cfg.index_head_dim != INDEX_DIM:
        raise EngineError(
            f"{model_dir} has {model_cfg.index_head_dim}-wide index keys; SGLang's NSA pages hold "
            f"{INDEX_DIM} (e.g. corpusd model init --preset sglang)"
        )
    if (info.n_layers, info.kv_dim) != (model_cfg.num_hidden_layers, want_dim) or not info.index:
        raise EngineError(
            f"{where}'s pool holds {info.n_layers} layers of {info.kv_dim}-wide rows"
            f"{'' if info.index else ' and no indexer pages'}; {model_dir} needs "
            f"{model_cfg.num_hidden_layers} of {want_dim} and NSA indexer pages"
        )
    version = str(server.get("version") or "unknown")
    return EngineCheck(engine, info, spool, version, model_dir, model_cfg, fp, dtype, kv_format)


def pin_engine(
    cfg: PinConfig,
    check: EngineCheck,
    stream: TextIO | None = None,
    admit: Callable[[int], None] | None = None,
) -> PinResult:
    """Pin ``cfg.corpus`` with ``check``'s server (module docstring). Raises CorpusError (bad
    source), EngineError (the server failed or its pages never came), StoreError; nothing is
    stored then."""
    out = stream if stream is not None else sys.stderr
    t0 = time.perf_counter()
    tokenizer, ingested, layout = tokenize(cfg, check.model_dir, check.model_cfg)
    tokens = list(layout.tokens)
    p, n_tok = cfg.page_size, len(tokens)
    fmt = page_format(check.dtype, check.kv_format)
    cid = corpus_id(layout.tokens, f"{check.fingerprint}|{check.marker}", p, fmt)
    if admit is not None:
        admit(-(-n_tok // p))
    store = PageStore(cfg.store or env.default_store_dir())
    if store.has(cid):
        m = store.manifest(cid)
        if cfg.name and cfg.name != m.name:  # one name per corpus, as corpusd's own pin says
            raise CorpusError(
                f"this content is already pinned through {check.marker} as {m.name!r} (corpus "
                f"{cid}); a corpus has one name: use {m.name!r} or its id, not --name {cfg.name!r}"
            )
        return PinResult(m, store.corpora / cid, check.model_dir, True, time.perf_counter() - t0)

    t_engine = time.perf_counter()
    keys = capture_pages(check, tokens, p, cfg.engine_timeout, out)
    t_engine = time.perf_counter() - t_engine
    pages = [read_checked_page(check, k) for k in keys]
    u = check.info
    manifest = Manifest(
        corpus_id=cid,
        name=cfg.name or default_name(str(cfg.corpus)) or cid[:12],
        state="ready",
        source_kind=ingested.source_kind,
        source_digest=ingested.source_digest,
        token_count=n_tok,
        page_size=p,
        n_pages=len(keys),
        n_layers=check.model_cfg.num_hidden_layers,
        kv_dim=check.model_cfg.kv_dim,
        index_dim=check.model_cfg.index_head_dim,
        dtype=check.dtype,
        model_fingerprint=check.fingerprint,
        tokenizer=tokenizer.name,
        files=tuple((s.path, s.start, s.end) for s in layout.spans),
        skipped=tuple((s.path, s.reason, s.detail) for s in ingested.skipped),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        prefill_seconds=round(t_engine, 3),
        kv_format=check.kv_format,
        engine={
            "marker": check.marker, "url": check.engine.url, "sglang_version": check.version,
            "model_path": u.model_path, "page_size": str(u.page_size), "kv_dtype": u.kv_dtype,
            "host_layout": u.layout,
        },
    )  # fmt: skip
    with store.writer(cid) as w:
        w.write_tokens(torch.tensor(tokens))
        for li in range(manifest.n_layers):
            rows, keys_f, index_pages = layer_rows(pages, li, n_tok, p, u.kv_dtype)
            w.write_layer(li, rows, keys_f.to(manifest.torch_dtype), p, index_pages)
        manifest = w.write_manifest(manifest)
    seconds = time.perf_counter() - t0
    return PinResult(manifest, store.corpora / cid, check.model_dir, False, seconds)


def capture_pages(
    check: EngineCheck, tokens: list[int], p: int, timeout: float, out: TextIO
) -> list[str]:
    """Have the server compute every page of ``tokens`` (module docstring) and wait, bounded by
    ``timeout`` and with a progress bar, until all are in its spool; returns the pages' keys.
    Raises EngineError."""
    n_pages, known = -(-len(tokens) // p), page_hashes(tokens, p)
    if len(known) == n_pages and all(page_path(check.spool, k).exists() for k in known):
        out.write(f"the engine's spool holds all {n_pages} pages already\n")
        return known
    # A prefix the server already holds is not backed up again: start from an empty radix tree.
    try:
        check.engine.flush_cache()
    except EngineError as e:  # busy: the prefill may still compute (and back up) every page
        out.write(f"note: could not flush the engine's cache first ({e})\n")
    n_new = -len(tokens) % p + 1
    answer: list[list[int]] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            answer.append(check.engine.generate(tokens, n_new, timeout))
        except BaseException as e:  # reported by the waiting thread
            failed.append(e)

    out.write(f"prefill of {len(tokens):,} tokens on {check.engine.url} ({check.marker})\n")
    threading.Thread(target=run, daemon=True, name="engine-generate").start()
    bar = Progress("engine", n_pages, unit="page", stream=out)
    keys, done = known, 0
    deadline = time.monotonic() + timeout
    while True:
        if failed:
            raise failed[0]
        if answer and len(keys) < n_pages:  # the generated tokens name the last page
            keys = page_hashes(tokens + answer[0][: n_new - 1], p)
            assert keys[: len(known)] == known and len(keys) == n_pages, f"{len(keys)=}"
        have = sum(page_path(check.spool, k).exists() for k in keys)
        bar.update(have - done)
        done = have
        if len(keys) == n_pages and have == n_pages:
            break
        if time.monotonic() > deadline:
            raise EngineError(
                f"engine {check.engine.url}: {n_pages - have} of {n_pages} pages did not reach "
                f"its spool {check.spool} in {timeout:g} s (is --hicache-write-policy "
                f"write_through set, and the host cache big enough?); nothing was stored"
            )
        time.sleep(0.1)
    bar.close()
    return keys


def read_checked_page(check: EngineCheck, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One spooled page, its shapes checked against the engine's report. Raises EngineError."""
    u = check.info
    try:
        kv, index = read_page(check.spool, key)
    except Exception as e:
        raise EngineError(f"spool page {key[:16]}… is unreadable: {e}") from None
    elt = "uint8" if u.kv_dtype == "fp8_e4m3" else u.kv_dtype
    want_kv = ((u.n_layers, u.page_size, u.kv_dim), elt)
    want_ix = (u.n_layers, u.page_size * INDEX_TOKEN_BYTES)
    got_kv = (tuple(kv.shape), str(kv.dtype).removeprefix("torch."))
    if got_kv != want_kv or index is None or tuple(index.shape) != want_ix:
        got_ix = None if index is None else tuple(index.shape)
        raise EngineError(
            f"spool page {key[:16]}… holds kv {got_kv}, index {got_ix}; the engine reports "
            f"{want_kv} and {want_ix}: is the spool shared by two servers?"
        )
    return kv, index


def layer_rows(
    pages: list[tuple[torch.Tensor, torch.Tensor]], layer: int, n_tok: int, p: int, kv_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of a corpus from its spooled pages: latent rows ``[n_tok, D]`` in corpusd's
    layout (bit for bit), float32 index keys ``[n_tok, 128]`` (:func:`index_page_keys`) and the
    indexer pages verbatim, uint8 ``[n_pages, P·132]`` (rows past ``n_tok`` zeroed)."""
    rows = torch.cat([corpusd_rows(kv[layer], kv_dtype) for kv, _ in pages])[:n_tok]
    index_pages = torch.stack([ix[layer] for _, ix in pages]).clone()
    if tail := n_tok % p:
        q_end = p * (INDEX_TOKEN_BYTES - 4)
        index_pages[-1, tail * (INDEX_TOKEN_BYTES - 4) : q_end] = 0
        index_pages[-1, q_end + tail * 4 :] = 0
    keys = torch.cat([index_page_keys(page, p) for page in index_pages])[:n_tok]
    return rows, keys, index_pages
