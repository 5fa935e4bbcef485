"""``corpusd pin``: corpus source → tokens → chunked prefill → pages in the local store.

Order matters for "bad input changes nothing": the source is ingested, validated and tokenized
(and the token limit checked) before the model is loaded or anything is written; the pages are
written to a temp directory and appear in the store only by one atomic rename.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import torch

from corpusd import env
from corpusd.corpus.config import DTYPES, PinConfig
from corpusd.corpus.ingest import CorpusError, Ingested, ingest
from corpusd.corpus.layout import Layout, render
from corpusd.corpus.manifest import Manifest, corpus_id, page_format
from corpusd.corpus.names import default_name
from corpusd.corpus.store import PageStore
from corpusd.kernels import fp8_cache as fp8
from corpusd.kernels.formats import FP8
from corpusd.model import KVCache, ModelConfig, fingerprint, forward_tokens, load_model
from corpusd.model.prefill_kernels import Kernels, choose
from corpusd.progress import Progress
from corpusd.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True, slots=True)
class PinResult:
    manifest: Manifest
    path: Path
    model_dir: Path
    reused: bool  # the same corpus (same id) was already pinned: no work was done
    seconds: float


# Real source files of corpusd itself, small enough to pin in seconds on a laptop CPU with the
# byte-level tokenizer (~9k tokens, well past index_topk so the indexer really selects).
DEMO_FILES = ("__init__.py", "env.py", "progress.py", "corpus/layout.py", "corpus/manifest.py")


def sample_repo(package: str = "") -> Path:
    """Write ``$CORPUSD_HOME/sample-repo.tar``: a few of corpusd's own source files; or, given
    an installed pure-Python ``package`` (e.g. ``prometheus_client``, a corpusd dependency:
    ~200 KB of real third-party source), ``$CORPUSD_HOME/<package>.tar`` of its ``*.py`` files.
    Raises CorpusError when ``package`` is not installed as a directory of sources."""
    import importlib.util
    import tarfile

    import corpusd

    if package:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(f"{package!r} is not an installed package (a directory of sources)")
        root = Path(next(iter(spec.submodule_search_locations)))
        files = [
            (f, f.relative_to(root.parent).as_posix())
            for f in sorted(root.rglob("*.py"))
            if "__pycache__" not in f.parts
        ]
        out = env.home() / f"{package}.tar"
    else:
        src = Path(corpusd.__file__).parent
        files = [(src / name, f"corpusd/{name}") for name in DEMO_FILES]
        out = env.home() / "sample-repo.tar"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for path, arcname in files:
            tar.add(path, arcname=arcname)
    return out


def default_model(stream: TextIO) -> Path:
    """The model directory when no ``--model`` is given: ``$CORPUSD_MODEL``, which must hold a
    model (a typo must not become a fresh random model that pins and serves); else the model of
    the ``corpusd up`` running in ``$CORPUSD_HOME`` (said on ``stream``: the daemons it started
    load only that one, as the coordinator address comes from it too); else the embedded tiny
    default, written on first use (deterministic, no network). Raises ValueError (one line) for
    a ``$CORPUSD_MODEL`` without a ``config.json``."""
    named = env.is_set("CORPUSD_MODEL")
    up = None if named else env.running_up()
    if up is not None and up.get("model") and (Path(up["model"]) / "config.json").is_file():
        stream.write(
            f"model {up['model']}: the running `corpusd up`'s (--model or $CORPUSD_MODEL for "
            "another)\n"
        )
        return Path(up["model"])
    d = env.default_model_dir()
    if named and not (d / "config.json").is_file():
        what = "does not exist" if not d.exists() else "holds no model (no config.json)"
        raise ValueError(
            f"$CORPUSD_MODEL={d} {what}; `corpusd model init {d}` writes the tiny "
            "model there, or unset it for the default"
        )
    if not (d / "config.json").is_file():
        from corpusd.model.tiny import init_tiny

        stream.write(f"writing the tiny default model to {d}\n")
        init_tiny(d)
    return d


def pin(
    cfg: PinConfig, stream: TextIO | None = None, admit: Callable[[int], None] | None = None
) -> PinResult:
    """Pin ``cfg.corpus``. Raises CorpusError (bad source), ModelConfigError/CheckpointError (bad
    model), ValueError (a latent row that does not fit ``cfg.kv_format``) before anything is
    written; StoreError on a store problem. ``admit(n_pages)`` is called once the tokens are
    counted, before the prefill: whatever it raises stops the pin with nothing written."""
    out = stream if stream is not None else sys.stderr
    t0 = time.perf_counter()
    if cfg.device != "cpu":
        check_device(cfg.device)
    model_dir = Path(cfg.model) if cfg.model else default_model(out)
    model_cfg = ModelConfig.from_dir(model_dir)
    if cfg.kv_format == FP8:
        fp8.check_layout(model_cfg.kv_lora_rank, model_cfg.qk_rope_head_dim)
    tokenizer, ingested, layout = tokenize(cfg, model_dir, model_cfg)
    fp = fingerprint(model_dir)
    cid = corpus_id(layout.tokens, fp, cfg.page_size, page_format(cfg.dtype, cfg.kv_format))
    if admit is not None:
        admit(-(-len(layout.tokens) // cfg.page_size))
    store = PageStore(cfg.store or env.default_store_dir())
    if store.has(cid):
        m = store.manifest(cid)
        if cfg.name and cfg.name != m.name:
            # One name per corpus: taking the new one silently made lookups by it fail.
            raise CorpusError(
                f"this content is already pinned as {m.name!r} (corpus {m.corpus_id}); a corpus "
                f"has one name: use {m.name!r} or its id, not --name {cfg.name!r}"
            )
        return PinResult(m, store.corpora / cid, model_dir, True, time.perf_counter() - t0)

    where = "" if cfg.device == "cpu" else f" on {cfg.device}"
    threads = cpu_threads() if cfg.device == "cpu" else 0  # the ones announced are the ones used
    out.write(f"prefill of {len(layout.tokens):,} tokens{where}: ")
    out.write(f"{estimate(len(layout.tokens), threads) if threads else cfg.dtype}\n")
    model = load_model(model_dir, dtype=getattr(torch, cfg.dtype), device=cfg.device)
    kernels = choose(model_cfg, cfg.device, getattr(torch, cfg.dtype), cfg.kernels)
    if cfg.device != "cpu":
        out.write(f"kernels: {kernels.describe}\n")
        warm_up(model, kernels)
    t_prefill = time.perf_counter()
    cache = prefill(model, layout, cfg.prefill_chunk, out, kernels, threads)
    t_prefill = time.perf_counter() - t_prefill
    name = cfg.name or default_name(str(cfg.corpus)) or cid[:12]
    manifest = Manifest(
        corpus_id=cid,
        name=name,
        state="ready",
        source_kind=ingested.source_kind,
        source_digest=ingested.source_digest,
        token_count=len(layout.tokens),
        page_size=cfg.page_size,
        n_pages=-(-len(layout.tokens) // cfg.page_size),
        n_layers=model_cfg.num_hidden_layers,
        kv_dim=model_cfg.kv_dim,
        index_dim=model_cfg.index_head_dim,
        dtype=cfg.dtype,
        model_fingerprint=fp,
        tokenizer=tokenizer.name,
        files=tuple((s.path, s.start, s.end) for s in layout.spans),
        skipped=tuple((s.path, s.reason, s.detail) for s in ingested.skipped),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        prefill_seconds=round(t_prefill, 3),
        kv_format=cfg.kv_format,
    )
    with store.writer(cid) as w:
        w.write_tokens(torch.tensor(layout.tokens))
        for layer in range(model_cfg.num_hidden_layers):
            n = cache.length
            latent = cache.latent[layer][:n].cpu()
            if cfg.kv_format == FP8:
                latent = fp8.quantize(latent)
            w.write_layer(layer, latent, cache.index_keys[layer][:n].cpu(), cfg.page_size)
        manifest = w.write_manifest(manifest)  # with the files' checksums and page digests
    return PinResult(manifest, store.corpora / cid, model_dir, False, time.perf_counter() - t0)


def tokenize(
    cfg: PinConfig, model_dir: Path, model_cfg: ModelConfig
) -> tuple[Tokenizer, Ingested, Layout]:
    """The model's tokenizer, the ingested source and its token stream (every pin's first
    steps; raises CorpusError for a bad source or one over the token limit)."""
    tokenizer = load_tokenizer(model_dir, model_cfg.bos_token_id, model_cfg.eos_token_id)
    ingested = ingest(cfg.corpus, max_file_bytes=cfg.max_file_bytes)
    positions = model_cfg.max_position_embeddings
    if positions < cfg.max_tokens:  # the model's own bound, which no flag raises
        remedy = f"the model reads at most {positions:,} positions (max_position_embeddings)"
        return tokenizer, ingested, render(ingested, tokenizer, positions, remedy)
    return tokenizer, ingested, render(ingested, tokenizer, cfg.max_tokens)


# The CPU prefill's cost model: a token at position p costs a·(1 + GROWTH·p) seconds, so n tokens
# take a·(n + GROWTH·n²/2). The projections, the MLP and the attention (over at most index_topk
# selected rows) cost the same at every position: a. The indexer scores every earlier token:
# a·GROWTH·p. GROWTH is that share's growth: 11.3 % of the time at mean position 2,048 in the
# profile of bench/results/pin-cpu.json (indexer scores and top-k), i.e. ~6.2e-5 per token, and
# 5.1e-5 from the issue-37 pin of h11-0.14.0 (86,361 tokens in 391 s at that file's rate). `a`
# itself varies several-fold with the machine's load and threads (279 to 471 tok/s on 2 idle
# threads in that file; the same tar at 84 tok/s on 1 thread at load 4-8), so the prior below
# (its 4,148-token row) is replaced, once MEASURE_TOKENS are done, by `a` measured on this
# prefill's own first chunks: that estimate is printed too.
GROWTH = 5.5e-5
_SECONDS_PER_TOKEN = 1.9e-3  # the prior a: pin-cpu.json's 4,148-token row, 8.8 s
MEASURE_TOKENS = 1024  # measure `a` over the first chunks up to this many tokens (or a quarter)


def prefill_seconds(tokens: int, a: float = _SECONDS_PER_TOKEN) -> float:
    """The model's seconds for a CPU prefill of ``tokens`` at ``a`` seconds per token."""
    return a * (tokens + GROWTH * tokens * tokens / 2)


def _when(s: float) -> str:
    if s < 1:
        return "under 1 s"
    return (
        f"about {s:,.1f} s"
        if s < 10
        else f"about {s:,.0f} s"
        if s < 120
        else (f"about {s / 60:,.1f} min")
    )


def estimate(tokens: int, threads: int) -> str:
    """A one-line prior estimate of a CPU prefill of ``tokens`` on ``threads`` threads, saying
    where it comes from (the measured one follows the first chunks)."""
    return (
        f"{_when(prefill_seconds(tokens))} on {threads} CPU thread{'s' if threads > 1 else ''} "
        "with the tiny model (prior: bench/results/pin-cpu.json; re-estimated on this machine "
        "after the first chunks)"
    )


def check_device(device: str) -> None:
    """ValueError (one line for the CLI) when ``device`` cannot run a prefill here."""
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch sees no CUDA GPU (use --device cpu)")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )


def cpu_threads() -> int:
    """Threads for a CPU prefill: the cores the rest of the machine leaves idle now
    (:func:`busy_cores`), at least 1. On a busy machine one thread beats all cores: each op
    ends in a barrier that waits for whichever of our threads was descheduled (measured on the
    shared 2-core machine at load ~11: 154 tok/s on 1 thread, 62 on 2). On an idle one every
    core counts (2-core machine, 8,251 tokens: 286 tok/s on 1 thread, 522 on 2).
    ``OMP_NUM_THREADS`` set by the user wins (the count torch already has). Its bits depend on
    the count: see :func:`torch_threads`."""
    cores = os.cpu_count() or 1
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, min(cores, int(cores - busy_cores() + 0.5)))


def busy_cores(window_s: float = 0.25) -> float:
    """Cores busy over the next ``window_s`` seconds, from the kernel's CPU counters
    (``/proc/stat``); the 1-minute load average where there are none. Not the load average
    first: it trails by minutes, so right after ``pip install`` and ``corpusd up`` it still
    read ~1.2 on an idle 2-core machine, and the README's demo prefilled on 1 thread of 2."""
    before = _cpu_counters()
    if before is None:
        return os.getloadavg()[0]
    time.sleep(window_s)
    after = _cpu_counters()
    assert after is not None
    idle, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return os.getloadavg()[0]
    return (os.cpu_count() or 1) * (1 - idle / total)


def _cpu_counters() -> tuple[int, int] | None:
    """(idle, total) jiffies of every CPU since boot: ``/proc/stat``'s first line (idle and
    iowait count as idle; guest time is already in user time); None without it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[3] + (ticks[4] if len(ticks) > 4 else 0), sum(ticks)


def _cost(tokens: int) -> float:
    """The cost model's work for the first ``tokens`` tokens, in units of ``a``."""
    return tokens + GROWTH * tokens * tokens / 2


def measured_seconds(tokens: int, first: int, first_s: float, done: int, seconds: float) -> float:
    """The whole prefill's seconds, once its first chunk (``first`` tokens) took ``first_s``
    and ``done`` tokens took ``seconds`` in all. The first chunk carries one-time costs (the
    allocator's first pages, the thread pool's start: up to 1.4× a later chunk's time on the
    2-core machine), so ``a`` is fitted on the chunks after it and the first is counted as
    measured."""
    a = (seconds - first_s) / (_cost(done) - _cost(first))
    return first_s + a * (_cost(tokens) - _cost(first))


def _measured(tokens: int, first: int, first_s: float, done: int, seconds: float, tty: bool) -> str:
    """The estimate line of a whole prefill (see :func:`measured_seconds`)."""
    s = measured_seconds(tokens, first, first_s, done, seconds)
    rate = (done - first) / (seconds - first_s)
    lead = "\n" if tty else ""  # off the progress bar's line
    return (
        f"{lead}prefill of {tokens:,} tokens: {_when(s)} in all (measured: {done - first:,} tokens "
        f"after the first chunk at {rate:,.0f} tok/s; the indexer's share grows with position)\n"
    )


def warm_up(model: torch.nn.Module, kernels: Kernels) -> None:
    """A GPU's one-time costs before the timed prefill: the scorer's compile, and one token
    through the model into a scratch cache (attention's first call and FlashMLA's LSE probe,
    cuBLAS and the allocator's first use)."""
    param = next(model.parameters())
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    kernels.warm_up(cfg, str(param.device), param.dtype)
    token = torch.zeros(1, dtype=torch.int64, device=param.device)
    forward_tokens(model, token, KVCache(cfg, 1, param.dtype, str(param.device)), False, kernels)  # type: ignore[arg-type]
    torch.cuda.synchronize(param.device)


def prefill(
    model: torch.nn.Module,
    layout: Layout,
    chunk: int,
    stream: TextIO,
    kernels: Kernels | None = None,
    threads: int = 0,
) -> KVCache:
    """Chunked prefill of the whole stream with a progress bar; returns the filled cache.

    Runs where ``model`` is (CPU or a CUDA device), in its dtype, the cache on the same device:
    ``chunk`` bounds the working set (the indexer's ``[chunk, T]`` scores, the gathered rows).
    ``kernels`` runs scores and attention (the torch references without). On CUDA the bar's
    rate is synchronised once per chunk, so it measures finished work. On CPU it runs on
    ``threads`` threads (0: :func:`cpu_threads`) and, after its first chunks, writes an estimate
    of the whole prefill from their measured rate (see GROWTH)."""
    param = next(model.parameters())
    tokens = torch.tensor(layout.tokens, device=param.device)
    cache = KVCache(model.cfg, len(tokens), param.dtype, device=str(param.device))  # type: ignore[arg-type]
    cpu = param.device.type == "cpu"
    n = len(tokens)
    measure = min(MEASURE_TOKENS, n // 4)
    first = first_s = 0.0  # the first chunk's tokens and seconds (see measured_seconds)
    with torch_threads((threads or cpu_threads()) if cpu else None) as used:
        if cpu:
            stream.write(f"on {used} of {os.cpu_count()} CPU threads\n")
        bar = Progress("prefill", n, stream=stream)
        for start in range(0, n, chunk):
            piece = tokens[start : start + chunk]
            forward_tokens(model, piece, cache, False, kernels)  # type: ignore[arg-type]
            if param.device.type == "cuda":
                torch.cuda.synchronize(param.device)
            bar.update(len(piece))
            done = start + len(piece)
            elapsed = time.perf_counter() - bar.t0
            if not start:
                first, first_s = done, elapsed
            elif cpu and measure and start - first < measure <= done - first and done < n:
                stream.write(_measured(n, int(first), first_s, done, elapsed, bar.tty))
        bar.close()
    return cache


@contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block on ``n`` torch CPU threads (the current count when None); yields the count
    in force and restores the one before on exit, whatever happens. A CPU prefill's bits depend
    on it (torch splits its reductions by thread count), so a pin equals a forward bit for bit
    only at the same count: the pin prints its count for that reason."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


__all__ = ["DTYPES", "CorpusError", "PinConfig", "PinResult", "pin", "prefill"]
