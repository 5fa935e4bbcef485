"""The holder's persisted assignment (``corpus → {page: frame}``), so a restart reloads it."""

from __future__ import annotations

import json
import os
from pathlib import Path


class AssignmentLog:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "assignments.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[str, dict[int, int]]:
        if not self.path.is_file():
            return {}
        raw = json.loads(self.path.read_text())
        return {cid: {int(p): int(f) for p, f in pages.items()} for cid, pages in raw.items()}

    def save(self, assignments: dict[str, dict[int, int]]) -> None:
        """Atomic replace: write, fsync, rename (a crash keeps the old or the new file)."""
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as f:
            json.dump({c: {str(p): fr for p, fr in pg.items()} for c, pg in assignments.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
