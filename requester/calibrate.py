"""``corpusd calibrate``: measure the cost model's constants against a live holder.

Every term of the predicate is measured, none assumed: the probe round trip (``Info``), the
effective bandwidth (``Fetch`` of 1…64 pages, least-squares slope), the holder's partial time over
a grid of rows × k (the ``compute_us`` it reports), the same partial on this process, the merge,
the splice (gather + k_pe rotation per row) and the re-prefill rate. The profile is JSON that
:class:`requester.predicate.Profile` loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from corpusd.corpus.manifest import PAGE_SIZE
from corpusd.corpus.store import PageStore
from corpusd.daemon import Daemon
from corpusd.kernels.merge import merge_partials
from corpusd.kernels.reference import partial_attention
from corpusd.model import DeepseekV32
from corpusd.model.rope import shift_band
from requester.corpus_view import CorpusView
from requester.holder_client import HolderClient
from requester.predicate import Profile
from requester.sources import LocalRows

GRID_ROWS: tuple[int, ...] = (1, 8, 32)
GRID_K: tuple[int, ...] = (128, 512, 2048)
#: ``--quick``: fewer points and repeats, against a probe corpus of random pages (no prefill),
#: so ``corpusd up`` can calibrate in seconds
QUICK_ROWS: tuple[int, ...] = (1, 8)
QUICK_K: tuple[int, ...] = (128, 512)
QUICK_REPEATS, QUICK_TOKENS = 2, 1024


def device_name() -> str:
    """What the profile was measured on: the GPU's name, else the CPU's model and core count."""
    if torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"cpu {model} x{os.cpu_count()}"


def _sample_too_long(model_dir: Path) -> str:
    """Why the sample repository cannot be pinned for the model at ``model_dir`` (its token
    stream passes the model's positions), or "" when it can."""
    from corpusd.corpus.ingest import CorpusError
    from corpusd.corpus.pin import PinConfig, sample_repo, tokenize
    from corpusd.model import ModelConfig

    try:
        cfg = PinConfig(corpus=str(sample_repo()), model=str(model_dir))
        tokenize(cfg, model_dir, ModelConfig.from_dir(model_dir))
    except CorpusError as e:
        return f"the sample repository does not fit this model ({e})"
    return ""


def probe_corpus(store: PageStore, model_dir: Path, tokens: int = QUICK_TOKENS) -> str:
    """A corpus of ``tokens`` random tokens with random pages, committed to ``store`` like a
    pin but without its prefill: timings do not depend on the values. Returns its id."""
    from dataclasses import replace

    from corpusd.corpus.manifest import Manifest, corpus_id
    from corpusd.model import ModelConfig, fingerprint

    cfg, fp = ModelConfig.from_dir(model_dir), fingerprint(model_dir)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, min(cfg.vocab_size, 256), (tokens,), generator=g)
    cid = corpus_id(tuple(toks.tolist()), fp, PAGE_SIZE, "float32")
    m = Manifest(
        corpus_id=cid, name="calibration-probe", state="ready", source_kind="calibration",
        source_digest="sha256:" + "0" * 64, token_count=tokens, page_size=PAGE_SIZE,
        n_pages=-(-tokens // PAGE_SIZE), n_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim,
        index_dim=cfg.index_head_dim, dtype="float32", model_fingerprint=fp, tokenizer="bytes",
    )  # fmt: skip
    with store.writer(cid) as w:
        w.write_tokens(toks)
        for layer in range(cfg.num_hidden_layers):
            lat = torch.randn(tokens, cfg.kv_dim, generator=g)
            keys = torch.randn(tokens, cfg.index_head_dim, generator=g)
            w.write_layer(layer, lat, keys, PAGE_SIZE)
        w.write_manifest(replace(m, checksums=dict(w.checksums)))
    return cid


async def _median_async(fn: Callable[[], Awaitable[Any]], repeats: int) -> float:
    await fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares ``y ≈ a + b·x`` with ``a, b ≥ 0``. When noise makes the free fit's base or
    slope negative, the line goes through the origin (all time is attributed to the work)."""
    xs = torch.tensor(x, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)
    a_mat = torch.stack([torch.ones_like(xs), xs], dim=1)
    sol = torch.linalg.lstsq(a_mat, yt[:, None]).solution
    a, b = float(sol[0, 0]), float(sol[1, 0])
    if a < 0 or b <= 0:
        return 0.0, max(float((xs * yt).sum() / (xs**2).sum()), 0.0)
    return a, b


async def calibrate(
    model: DeepseekV32,
    client: HolderClient,
    corpus_id: str,
    tokens: torch.Tensor,
    repeats: int = 5,
    log: Callable[[str], None] = print,
    grid_rows: tuple[int, ...] = GRID_ROWS,
    grid_k: tuple[int, ...] = GRID_K,
    prefill_tokens: int = 256,
) -> Profile:
    """Measure every constant against ``client``'s holder, which holds all of ``corpus_id``
    (``tokens`` are its token ids, for the re-prefill rate over the first ``prefill_tokens``)."""
    cfg = model.cfg
    h, d, d_v = cfg.num_attention_heads, cfg.kv_dim, cfg.kv_lora_rank
    view = await CorpusView.from_holders(corpus_id, {client.address: client})
    t = view.token_count
    g = torch.Generator().manual_seed(0)

    alpha = await _median_async(client.info, repeats * 4)
    log(f"probe round trip (Info)          {alpha:9.0f} µs")

    sizes = sorted({s for s in (1, 4, 16, 64) if s <= view.n_pages})
    fetch_us = [
        await _median_async(
            functools.partial(client.fetch, corpus_id, list(range(s)), [0]), repeats
        )
        for s in sizes
    ]
    page_bytes = view.page_size * d * 4
    _, us_per_byte = fit_line([s * page_bytes for s in sizes], fetch_us)
    beta = 1.0 / us_per_byte if us_per_byte > 0 else 1e6
    log(f"effective bandwidth (Fetch fit)  {beta:9.0f} B/µs ({beta / 1e3:.2f} GB/s)")

    kv = torch.randn(t, d, generator=g)
    xs, holder_us, local_us = [], [], []
    for n in grid_rows:
        for k in (k for k in grid_k if k <= t):
            q = torch.randn(n, h, d, generator=g)
            pos = torch.stack([torch.randperm(t, generator=g)[:k].sort().values for _ in range(n)])
            _, rows = view.pool_rows(pos)
            reported: list[float] = []

            async def attend(
                q: torch.Tensor = q, rows: torch.Tensor = rows, out: list[float] = reported
            ) -> None:
                out.append((await client.attend_rows(corpus_id, 0, q, rows, 0.1)).compute_us)

            await _median_async(attend, repeats)
            xs.append(float(n * k * h))
            holder_us.append(statistics.median(reported[1:]))
            local_us.append(
                _median(functools.partial(partial_attention, q, kv, pos, 0.1, d_v), repeats)
            )
    hb, hc = fit_line(xs, holder_us)
    lb, lc = fit_line(xs, local_us)
    log(f"holder partial                   {hb:9.0f} µs + {hc * 1e3:.3f} ns·n·k·h")
    log(f"requester partial                {lb:9.0f} µs + {lc * 1e3:.3f} ns·n·k·h")

    n = 32
    parts = [
        (torch.randn(n, h, d_v, generator=g), torch.randn(n, h, generator=g)) for _ in range(3)
    ]
    merge = _median(lambda: merge_partials(parts), repeats) / (n * h)
    rows_n = min(t, 4096)
    cos, sin = model.rotary.shift(torch.full((rows_n,), 37))
    splice = _median(lambda: shift_band(kv[:rows_n], d_v, d - d_v, cos, sin), repeats) / rows_n
    log(f"merge                            {merge * 1e3:9.3f} ns per row·head")
    log(f"splice (k_pe rotation)           {splice * 1e3:9.3f} ns per row")

    chunk = min(prefill_tokens, t)
    local = LocalRows(model, tokens.to(torch.int64))
    t0 = time.perf_counter()
    local.ensure(chunk)
    prefill = (time.perf_counter() - t0) * 1e6 / chunk
    log(f"re-prefill                       {prefill:9.0f} µs per token (first {chunk})")
    return Profile(
        transport="grpc-loopback" if client.address.startswith(("127.", "localhost")) else "grpc",
        alpha_us=alpha,
        beta_bytes_per_us=beta,
        holder_partial_base_us=hb,
        holder_partial_us_per_nkh=hc,
        local_partial_base_us=lb,
        local_partial_us_per_nkh=lc,
        merge_us_per_nh=merge,
        splice_us_per_row=splice,
        prefill_us_per_token=prefill,
        source=f"corpusd calibrate against {client.address} ({time.strftime('%Y-%m-%d %H:%M')})",
    )


#: ``holder.launch.start_holder``'s shape: (store, state dir, model dir) → a serving holder.
#: The CLI passes it in, so that this module (a requester's) never imports the holder.
StartHolder = Callable[[Path, Path, Path], Daemon]


def run(
    model_dir: str | None,
    store_dir: str,
    out: str,
    holder: str,
    corpus: str,
    repeats: int,
    start_holder: StartHolder,
    quick: bool = False,
) -> Profile:
    """The CLI's work: against ``holder`` (which must hold ``corpus``), or, when no holder is
    given, one ``start_holder`` starts here on loopback over the sample repository pinned into
    the store (``quick``: over a probe corpus of random pages in a temporary store, with fewer
    points and repeats). Writes the profile, stamped with the model's fingerprint, the device
    and the time, to ``out`` ("" = ``$CORPUSD_HOME/profile.json``)."""
    import asyncio
    import shutil
    import sys
    import tempfile

    from corpusd import env
    from corpusd.corpus.pin import PinConfig, default_model, pin, sample_repo
    from corpusd.model import fingerprint, load_model

    t_start = time.perf_counter()
    mdir = Path(model_dir) if model_dir else default_model(sys.stderr)
    scratch = Path(tempfile.mkdtemp(prefix="corpusd-calibrate-"))
    quick_store = quick and not holder
    store = PageStore(
        scratch / "store"
        if quick_store
        else Path(store_dir)
        if store_dir
        else env.default_store_dir()
    )
    model = load_model(mdir, dtype=torch.float32)
    proc = None
    reps, rows, ks, chunk = repeats, GRID_ROWS, GRID_K, 256
    if quick:
        reps, rows, ks, chunk = min(repeats, QUICK_REPEATS), QUICK_ROWS, QUICK_K, 64
    probe_tokens = QUICK_TOKENS
    if not quick and not holder and (why := _sample_too_long(mdir)):
        # a model of few positions: the sample repository cannot be pinned for it, so a probe
        # corpus as long as it reads, in a scratch store (timings do not depend on values)
        probe_tokens = min(model.cfg.max_position_embeddings, max(GRID_K))
        print(f"{why}: calibrating over a probe corpus of {probe_tokens:,} random tokens instead")
        quick_store, store = True, PageStore(scratch / "store")
    if quick_store:
        corpus = probe_corpus(store, mdir, probe_tokens)
        proc = start_holder(store.root, scratch / "holder", mdir)
        holder = proc.address
    elif not holder:
        corpus = pin(
            PinConfig(
                corpus=str(sample_repo()),
                model=str(mdir),
                store=str(store.root),
                name="sample-repo",
            )
        ).manifest.corpus_id
        proc = start_holder(store.root, scratch / "holder", mdir)
        holder = proc.address
    elif not corpus:
        raise ValueError(
            "--holder needs --corpus (a corpus of the store that holder holds, or can load)"
        )
    corpus = store.resolve(corpus)

    async def go() -> Profile:
        client = HolderClient(holder)
        assigned = False
        try:
            held = {c.corpus_id for c in (await client.info()).corpora if c.frames}
            if corpus not in held:  # a probe corpus on a holder of `corpusd up`, or ours
                await client.assign(corpus)
                assigned = True
            return await calibrate(
                model, client, corpus, store.read_tokens(corpus), reps, print, rows, ks, chunk
            )
        finally:
            if assigned:  # leave the holder as it was
                await client.release(corpus)
            await client.close()

    try:
        profile = asyncio.run(go())
    finally:
        if proc is not None:
            proc.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    profile = dataclasses.replace(
        profile,
        model_fingerprint=fingerprint(mdir),
        device=device_name(),
        created_at=time.time(),
        mode="quick" if quick else "full",
    )
    path = Path(out) if out else env.home() / "profile.json"
    profile.save(path)
    print(f"wrote {path} ({profile.mode}, {time.perf_counter() - t_start:.1f} s)")
    return profile
