"""``corpusd pin``: the pin, its one-screen summary, and the publish through a coordinator (the
CLI's pin command, and ``demo``, which pins a sample repository with it; torch and the store are
imported when one runs, as in :mod:`corpusd.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from corpusd import env
from corpusd.coordinator.client import CoordinatorClient, CoordinatorError, PageTable
from corpusd.coordinator.config import PublishConfig
from corpusd.corpus.config import PinConfig
from corpusd.corpus.manifest import page_format

if TYPE_CHECKING:
    from corpusd.corpus.pin import PinResult


def _pin_config(a: argparse.Namespace, corpus: str) -> PinConfig:
    values = {f.name: getattr(a, f.name) for f in fields(PinConfig) if f.name != "corpus"}
    return PinConfig(corpus=corpus, **values)


def count(n: int, noun: str) -> str:
    """``n`` with thousands separators and the noun in the number it takes: "1 file",
    "1,460 pages"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def summary(r: PinResult) -> str:
    """The one-screen report printed after a pin."""
    m = r.manifest
    disk = sum(f.stat().st_size for f in r.path.iterdir())
    per_layer = m.n_pages * m.page_size * m.token_layer_bytes
    reasons: dict[str, int] = {}
    for _, reason, _ in m.skipped:
        reasons[reason] = reasons.get(reason, 0) + 1
    skipped = ", ".join(f"{n} {k}" for k, n in sorted(reasons.items())) or "none"
    rate = m.token_count / m.prefill_seconds if m.prefill_seconds else 0.0
    biggest = sorted(m.files, key=lambda f: f[1] - f[2])[:5]
    lines = [
        f"{'already pinned' if r.reused else 'pinned'}: {m.name}  (corpus {m.corpus_id})",
        f"  source    {m.source_kind}, {m.source_digest[:19]}…  {count(len(m.files), 'file')}, "
        f"skipped: {skipped}",
        f"  tokens    {m.token_count:,} → {count(m.n_pages, 'page')} of {m.page_size}",
        f"  model     {r.model_dir}  ({m.n_layers} layers, {m.tokenizer})",
        f"  cache     {m.page_format}, per layer {mib(per_layer)} "
        f"(latent {m.kv_dim}{' as fp8 rows' if m.kv_format != 'plain' else ''} + index "
        f"{m.index_dim} per token), {mib(disk)} on disk",
        *(
            [
                f"  engine    {m.engine['marker']} at {m.engine['url']} ({m.engine['kv_dtype']} "
                f"KV cache, page {m.engine['page_size']}, model {m.engine['model_path']})"
            ]
            if m.engine
            else []
        ),
        f"  prefill   {m.prefill_seconds:,.1f} s ({rate:,.0f} tok/s)"
        + ("  [done earlier; nothing recomputed]" if r.reused else ""),
        f"  stored    {r.path}",
        "  largest files (tokens):",
        *(f"    {e - s:>9,}  {p}" for p, s, e in biggest),
    ]
    return "\n".join(lines)


def cmd_pin(a: argparse.Namespace) -> int:
    """Pin, then publish through the coordinator when there is one. Everything the coordinator
    would refuse is checked first (``preflight``), so a doomed pin fails in seconds, not after
    its prefill; a pin that was not published says so, and a failed publish exits non-zero."""
    from corpusd.coordinator import preflight

    publish = PublishConfig(**{f.name: getattr(a, f.name) for f in fields(PublishConfig)})
    cfg = _pin_config(a, a.corpus)
    check = None
    if cfg.engine:  # the engine decides the page format: asked first, before the coordinator
        from corpusd.engine.pin import check_engine

        check = check_engine(cfg)
        cfg = replace(cfg, model=str(check.model_dir), dtype=check.dtype, kv_format=check.kv_format)
    address, source = env.coordinator_source(publish.coordinator)
    admit = None
    if address:
        holders = asyncio.run(preflight.live_holders(address, source))
        from corpusd.corpus.pin import default_model
        from corpusd.model import fingerprint

        model_dir = Path(cfg.model) if cfg.model else default_model(sys.stderr)
        cfg = replace(cfg, model=str(model_dir))
        fp = fingerprint(model_dir)
        want = page_format(cfg.dtype, cfg.kv_format)
        loads = preflight.fitting(holders, publish.replicas, fp, cfg.page_size, want)

        def admit(pages: int) -> None:
            if note := preflight.room(loads, pages, publish.replicas):
                print(f"note: {note}")

    if check is not None:
        from corpusd.engine.pin import pin_engine

        r = pin_engine(cfg, check, admit=admit)
    else:
        from corpusd.corpus.pin import pin

        r = pin(cfg, admit=admit)
    print(summary(r))
    if not address:
        print(f"not published: no coordinator ({source}); publish with --coordinator or corpusd up")
        return 0
    try:
        table = asyncio.run(_publish(address, r.manifest.corpus_id, publish))
    except CoordinatorError as e:
        raise CoordinatorError(e.code, f"{e.detail} (pinned in {r.path}, not published)") from None
    print(published(table, address))
    return 0


async def _publish(address: str, corpus_id: str, cfg: PublishConfig) -> PageTable:
    async with CoordinatorClient(address) as c:
        wait = cfg.wait_s > 0
        return await c.pin(corpus_id, cfg.replicas, wait=wait, timeout=cfg.wait_s or None)


def published(t: PageTable, address: str) -> str:
    c = t.corpus
    if c.state == "queued":
        return (
            f"queued at {address} (position {c.queue_position}): it does not fit on the live "
            f"holders now; it is placed when capacity frees (see corpusd status)"
        )
    spans = ", ".join(f"{h} ({count(len(t.frames_on(h)), 'page')})" for h in sorted(t.holders))
    return f"published via {address}: {count(c.pages, 'page')} × {c.replicas} on {spans}"


def cmd_demo(a: argparse.Namespace) -> int:
    """Pin a sample repository: a tar of a few of corpusd's own source files, or (--package)
    of an installed package's source."""
    from corpusd.corpus.pin import DEMO_FILES, sample_repo

    out = sample_repo(a.package)
    what = (
        f"{a.package}'s installed source"
        if a.package
        else (f"{len(DEMO_FILES)} files of corpusd's own source")
    )
    print(f"sample repository: {out} ({what}, {out.stat().st_size:,} bytes)")
    a.name = a.name or a.package or "sample-repo"
    a.corpus = str(out)
    return cmd_pin(a)
