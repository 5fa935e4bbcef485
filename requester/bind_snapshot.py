"""What an agent needs to bind a corpus without its coordinator: the coordinator's corpus list
and the holder addresses of each corpus, as last read, kept in the agent's state dir
(``coordinator-snapshot.json``, written atomically: a temporary file renamed over it).

An agent restarted while its coordinator is down (the soak's ``kill:coordinator`` faults) had
nothing to resolve a corpus name with, and every new session failed UNAVAILABLE although the
holders served. With the snapshot it resolves the name and asks those holders what they hold
(:meth:`requester.corpus_view.CorpusView.from_holders`), as an agent without a coordinator
does.

Why a stale snapshot cannot give wrong tokens:

- it holds no page → frame map: the view is built from the holders' own answers at bind
  time, so a corpus re-placed since the snapshot is bound where it is now;
- a corpus id is the hash of its tokens, model fingerprint and page size, so a name that
  resolves to an older id binds that exact corpus or nothing (a holder that no longer holds it
  does not report it: CorpusUnavailable, never another corpus's pages); a name re-pinned to new
  content since the snapshot binds the old content, still whole, until the coordinator is back;
- every Attend names its corpus and the holder refuses rows outside that corpus's frames
  (``holder.pool.rows_outside``; OUT_OF_RANGE), so a view gone stale after binding fails over
  instead of reading another corpus;
- a corpus of another model is refused by its fingerprint, as from the coordinator.

When the coordinator answers again, the binding's page table is re-read like any other
(:mod:`requester.table_refresh`) and the snapshot is rewritten at the next bind.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from corpusd.coordinator.client import CorpusStatus

log = logging.getLogger("corpusd.agent")
FILE = "coordinator-snapshot.json"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The coordinator's corpora and each corpus's holder addresses at ``saved_at`` (Unix
    seconds)."""

    corpora: tuple[CorpusStatus, ...]
    holders: dict[str, tuple[str, ...]]  # corpus id → holder addresses
    saved_at: float

    def addresses(self, corpus_id: str) -> tuple[str, ...]:
        """The holders to ask for ``corpus_id``: its own, else every holder known."""
        own = self.holders.get(corpus_id)
        if own:
            return own
        return tuple(sorted({a for hs in self.holders.values() for a in hs}))

    def age(self, now: float | None = None) -> str:
        return f"{(time.time() if now is None else now) - self.saved_at:.0f} s old"


def save(state_dir: Path, corpora: list[CorpusStatus], corpus_id: str, holders: list[str]) -> None:
    """Record the corpus list just read and ``corpus_id``'s holders (kept beside those of the
    corpora recorded before, while they are still listed). Atomic: a crash leaves the old file
    or the new one. A write that fails is logged, never raised (the bind it follows stands)."""
    path = state_dir / FILE
    old = load(state_dir)
    listed = {c.corpus_id for c in corpora}
    kept = {c: hs for c, hs in (old.holders if old else {}).items() if c in listed}
    kept[corpus_id] = tuple(holders)
    body = {
        "version": VERSION,
        "saved_at": time.time(),
        "corpora": [asdict(c) for c in corpora],
        "holders": {c: list(hs) for c, hs in sorted(kept.items())},
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write the coordinator snapshot %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def load(state_dir: Path) -> Snapshot | None:
    """The snapshot in ``state_dir``, or None when there is none or it cannot be read (logged:
    a damaged file is as good as none)."""
    path = state_dir / FILE
    try:
        body = json.loads(path.read_text())
        if body.get("version") != VERSION:
            raise ValueError(f"version {body.get('version')!r}, not {VERSION}")
        names = {f.name for f in fields(CorpusStatus)}
        corpora = tuple(CorpusStatus(**_corpus(c, names)) for c in body["corpora"])
        holders = {str(c): tuple(map(str, hs)) for c, hs in body["holders"].items()}
        return Snapshot(corpora, holders, float(body["saved_at"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring the coordinator snapshot %s: %s", path, e)
        return None


def _corpus(c: dict[str, Any], names: set[str]) -> dict[str, Any]:
    out = {k: v for k, v in c.items() if k in names}
    for k in ("holder_ids", "expired_holders"):
        out[k] = tuple(out.get(k, ()))
    return out
