"""Every environment variable corpusd reads, in one place (all prefixed ``CORPUSD_``), and the
defaults they resolve to — the coordinator's through the ``up.json`` of a running ``corpusd up``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: name → (meaning, default) — the README's table is generated from this mapping's content.
VARIABLES = {
    "CORPUSD_HOME": ("state directory: default model and store live under it", "~/.corpusd"),
    "CORPUSD_MODEL": (
        "model directory used when --model is not given",
        "$CORPUSD_HOME/models/tiny",
    ),
    "CORPUSD_STORE": ("page store used when --store is not given", "$CORPUSD_HOME/store"),
    "CORPUSD_COORDINATOR": (
        "coordinator address (host:port) when --coordinator is not given",
        "the one `corpusd up` runs, if any",
    ),
    "CORPUSD_TLS_CA": (
        "PEM CA every peer's certificate must chain to; with it, clients speak TLS",
        "a running secure `corpusd up`'s, for loopback addresses",
    ),
    "CORPUSD_TLS_CERT": ("PEM certificate this process presents (mutual TLS)", "as above"),
    "CORPUSD_TLS_KEY": ("the key of CORPUSD_TLS_CERT", "as above"),
    "CORPUSD_TOKEN": (
        "bearer token this process sends (its right: admin, agent or holder); TLS only",
        "as above (`up`'s admin token)",
    ),
    "CORPUSD_CALIBRATE": (
        "corpusd up: calibrate the cost model when the profile is missing or stale (auto), "
        "always, or off; --calibrate overrides it",
        "auto",
    ),
    "CORPUSD_SGLANG_PATH": (
        "SGLang plugin: device (holder pools by CUDA IPC, CUDA graphs on), host (gRPC), or auto",
        "auto",
    ),
    "CORPUSD_SGLANG_WINDOW": (
        "SGLang plugin, device path: the longest corpus one decode step scores (tokens)",
        "16384",
    ),
    "CORPUSD_SGLANG_ARENA": (
        "SGLang plugin, device path: index-key arena for every bound corpus (tokens)",
        "65536",
    ),
    "CORPUSD_SGLANG_PRIMITIVE": (
        "SGLang plugin, host path: route or fetch per layer and holder group by the cost model "
        "(auto), or forced (route, fetch)",
        "auto",
    ),
    "CORPUSD_SGLANG_PAGE_CACHE_MB": (
        "SGLang plugin, host path: GPU page cache for fetched corpus pages, all layers (0: no "
        "fetch)",
        "256",
    ),
    "CORPUSD_SGLANG_TABLE_REFRESH_S": (
        "SGLang plugin, host path: re-read each bound corpus's page table this often (seconds), "
        "so running requests follow load replicas; 0: the coordinator's lease / 3; -1: never",
        "the coordinator's lease / 3 (10 / 3 s if it does not say)",
    ),
    "CORPUSD_SGLANG_PROFILE": (
        "SGLang plugin: the calibration profile (`corpusd calibrate`) its predicate uses",
        "$CORPUSD_HOME/profile.json if present",
    ),
    "CORPUSD_SGLANG_METRICS_PORT": (
        "SGLang plugin: serve its Prometheus metrics (decisions, measured/predicted cost, page "
        "cache) on this loopback port",
        "unset: not served",
    ),
    "CORPUSD_SGLANG_TRACE": (
        "SGLang plugin: append every route/fetch decision with its costs to this JSON-lines file",
        "unset",
    ),
    "CORPUSD_SGLANG_PROFILE_SLOW": (
        "SGLang plugin: profile each bound prefill on the host (cProfile), wait for it, and log "
        "one that takes over this many seconds (1 if not a number) with its GPU time and "
        "profile, and log every Triton compile (a diagnosis aid; it slows prefills)",
        "unset",
    ),
    "CORPUSD_SGLANG_DUMP": (
        "SGLang, a diagnosis aid (tools/diag_layer_diff.py): write the last row per forward "
        "and layer (indexer selection and scores, attention output, hidden state) of each "
        "request whose rid contains 'diag' to this directory; read by the plugin and by the "
        "stock dump package "
        "(SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang.stockdump); slows every forward",
        "unset",
    ),
}


#: The one wording for "no coordinator was found", wherever a command needs one.
NO_COORDINATOR = (
    "no coordinator: start `corpusd up`, pass --coordinator HOST:PORT or set $CORPUSD_COORDINATOR"
)
#: How every --coordinator flag's default is found (see ``coordinator``).
COORDINATOR_DEFAULT = "$CORPUSD_COORDINATOR, else the running `corpusd up`'s (its up.json)"


CALIBRATE_MODES = ("auto", "always", "off")


def calibrate_mode(flag: str = "") -> str:
    """``corpusd up``'s calibration: the flag, else $CORPUSD_CALIBRATE, else auto. Raises
    ValueError for another value."""
    mode = flag or os.environ.get("CORPUSD_CALIBRATE", "") or "auto"
    if mode not in CALIBRATE_MODES:
        where = "--calibrate" if flag else "$CORPUSD_CALIBRATE"
        raise ValueError(f"{where}: {mode!r}; one of {', '.join(CALIBRATE_MODES)}")
    return mode


def home() -> Path:
    return Path(os.environ.get("CORPUSD_HOME", "~/.corpusd")).expanduser()


def default_model_dir() -> Path:
    env = os.environ.get("CORPUSD_MODEL")
    return Path(env).expanduser() if env else home() / "models" / "tiny"


def default_store_dir() -> Path:
    env = os.environ.get("CORPUSD_STORE")
    return Path(env).expanduser() if env else home() / "store"


def coordinator(flag: str) -> str:
    """The coordinator address: the flag, else $CORPUSD_COORDINATOR, else the one a running
    ``corpusd up`` started (its ``up.json``), else ""."""
    return coordinator_source(flag)[0]


def coordinator_source(flag: str) -> tuple[str, str]:
    """``(address, where it came from)`` as ``coordinator`` resolves it; with no address,
    ``("", why there is none)``."""
    if flag:
        return flag, "--coordinator"
    if os.environ.get("CORPUSD_COORDINATOR"):
        return os.environ["CORPUSD_COORDINATOR"], "$CORPUSD_COORDINATOR"
    path = up_dir() / "up.json"
    info = running_up()
    if info:
        return str(info["coordinator"]["address"]), f"{path} (stale?)"
    if path.exists():
        return "", f"{path} is stale: the `corpusd up` that wrote it is not running"
    return "", "no --coordinator, $CORPUSD_COORDINATOR or running `corpusd up`"


def up_dir(flag: str = "") -> Path:
    """Where ``corpusd up`` keeps every daemon's state, and its ``up.json`` while it runs."""
    return Path(flag).expanduser() if flag else home() / "up"


def running_up(flag: str = "") -> dict[str, Any] | None:
    """``up.json`` of a ``corpusd up`` that is still running in ``up_dir(flag)``, else None."""
    path = up_dir(flag) / "up.json"
    try:
        info: dict[str, Any] = json.loads(path.read_text())
        pid = int(info["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError):
        return None
    return None if zombie(pid) else info


def zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (it still answers ``kill(pid, 0)``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return False
