"""A coordinator on SQLite (the default) never imports the etcd client: machines without
``aetcd`` (the offline GPU machines) still run one. Found when a GPU run's coordinator died of
``ModuleNotFoundError: aetcd`` at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sqlite_coordinator_modules_do_not_import_aetcd() -> None:
    code = (
        "import sys\n"
        "import corpusd.coordinator.server, corpusd.coordinator.service\n"
        "import corpusd.coordinator.election, corpusd.coordinator.db\n"
        "from corpusd.coordinator.db import open_state\n"
        "import tempfile\n"
        "open_state('sqlite', tempfile.mkdtemp())\n"
        "assert 'aetcd' not in sys.modules, sorted(m for m in sys.modules if 'etcd' in m)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
