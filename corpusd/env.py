"""Every ``CORPUSD_*`` environment variable corpusd reads, in one typed registry
(:data:`VARIABLES`), and the defaults derived from them: the model, the store, the coordinator
(through the ``up.json`` of a running ``corpusd up``).

Read a variable with :func:`get`: it returns the typed value (the default when the variable is
unset or empty) and raises :class:`EnvError` naming the variable, its value and what is allowed.
Nothing else in the tree reads ``os.environ`` for a ``CORPUSD_*`` name
(``tests/unit/test_env.py`` holds this). The README's table is this registry's
``python -m corpusd.env --markdown``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("str", "int", "float", "bool", "path", "choice")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvError(ValueError):
    """A ``CORPUSD_*`` variable holds a value its type or range refuses."""


@dataclass(frozen=True, slots=True)
class Var:
    """One variable. ``default`` is its text when unset (None: unset means "not given", and
    :func:`get` returns None); ``shown`` is how the README shows a default derived at run time.
    ``low``/``high`` bound an int or float (``also``: values allowed outside them); ``check``
    returns what is wrong with a parsed value ("" if nothing); ``parse`` replaces the kind's own
    parser; ``expect`` says in words what a good value is (errors end with it)."""

    name: str
    kind: str
    help: str
    default: str | None = None
    shown: str = ""
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    also: tuple[float, ...] = ()
    check: Callable[[Any], str] | None = None
    parse: Callable[[str], Any] | None = None
    expect: str = ""

    def __post_init__(self) -> None:
        assert self.name.startswith("CORPUSD_"), f"{self.name}: corpusd's variables are CORPUSD_*"
        assert self.kind in KINDS, f"{self.name}: kind {self.kind!r} is not one of {KINDS}"
        assert (self.kind == "choice") == bool(self.choices), f"{self.name}: choices ⇔ choice"

    def wants(self) -> str:
        """What a good value is, in words."""
        if self.expect:
            return self.expect
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "bool":
            return f"a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})"
        what = {"int": "a whole number", "float": "a number", "str": "text", "path": "a path"}
        rng = "".join(
            f" {op} {v:g}" for op, v in ((">=", self.low), ("<=", self.high)) if v is not None
        )
        return what[self.kind] + rng

    def value(self, raw: str | None) -> Any:
        """``raw`` (the variable's text; None or blank: unset) as its type. Raises EnvError."""
        if raw is None or not raw.strip():
            return None if self.default is None else self.value(self.default)
        try:
            v = self.parse(raw) if self.parse is not None else self._parse(raw.strip())
        except ValueError:
            raise EnvError(f"{self.name}={raw!r}: {self.wants()}") from None
        wrong = self.check(v) if self.check is not None else ""
        if not wrong and self.kind in ("int", "float") and self._out_of_range(v):
            wrong = self.wants()
        if not wrong and self.kind == "choice" and v not in self.choices:
            wrong = self.wants()
        if wrong:
            raise EnvError(f"{self.name}={raw!r}: {wrong}")
        return v

    def _out_of_range(self, v: float) -> bool:
        if v in self.also:
            return False
        return (self.low is not None and v < self.low) or (self.high is not None and v > self.high)

    def _parse(self, s: str) -> Any:
        if self.kind == "int":
            return int(s)
        if self.kind == "float":
            f = float(s)
            if not math.isfinite(f):
                raise ValueError(s)
            return f
        if self.kind == "bool":
            if s.lower() in _TRUE + _FALSE:
                return s.lower() in _TRUE
            raise ValueError(s)
        if self.kind == "path":
            return Path(s).expanduser()
        if self.kind == "choice":
            return s.lower()
        return s


def _slow_seconds(raw: str) -> float:
    """``CORPUSD_SGLANG_PROFILE_SLOW`` is also a switch: a positive number of seconds is the
    threshold, anything else set (``1``, ``yes``) means 1 s."""
    try:
        s = float(raw)
    except ValueError:
        return 1.0
    return s if s > 0 and math.isfinite(s) else 1.0


_LOCAL = (
    "local is stock SGLang's own prefill of the corpus, chosen per request (send the corpus in "
    "the prompt, without a corpus binding), not per layer inside the plugin; use auto, route or "
    "fetch"
)
CALIBRATE_MODES = ("auto", "always", "off")
SGLANG_PATHS = ("auto", "device", "host")
SGLANG_PRIMITIVES = ("auto", "route", "fetch")

#: Every variable, in the README's order.
VARIABLES: tuple[Var, ...] = (
    Var("CORPUSD_HOME", "path", "state directory: the default model and store live under it",
        default="~/.corpusd"),
    Var("CORPUSD_MODEL", "path", "model directory used when `--model` is not given",
        shown="the running `corpusd up`'s model, else `$CORPUSD_HOME/models/tiny`"),
    Var("CORPUSD_STORE", "path", "page store used when `--store` is not given",
        shown="`$CORPUSD_HOME/store`"),
    Var("CORPUSD_COORDINATOR", "str",
        "coordinator address (host:port) when `--coordinator` is not given",
        shown="the one `corpusd up` runs, if any"),
    Var("CORPUSD_MALLOC_TRIM_S", "float",
        "every daemon hands glibc's free heap pages back to the system this often (seconds; "
        "`0`: never); its heap is `corpusd_heap_bytes{state}` on /metrics",
        default="30", low=0, expect="seconds, a number >= 0 (0: never)"),
    Var("CORPUSD_TLS_CA", "path",
        "PEM CA every peer's certificate must chain to; with it, clients speak TLS",
        shown="a running secure `corpusd up`'s, for loopback addresses"),
    Var("CORPUSD_TLS_CERT", "path", "PEM certificate this process presents (mutual TLS)",
        shown="as above"),
    Var("CORPUSD_TLS_KEY", "path", "the key of `CORPUSD_TLS_CERT`", shown="as above"),
    Var("CORPUSD_TOKEN", "str",
        "bearer token this process sends (its right: admin, agent or holder); TLS only",
        shown="as above (`up`'s admin token)"),
    Var("CORPUSD_CALIBRATE", "choice",
        "`corpusd up`: calibrate the cost model when the profile is missing or stale (`auto`), "
        "`always`, or `off`; `--calibrate` overrides it",
        default="auto", choices=CALIBRATE_MODES),
    Var("CORPUSD_SGLANG_PATH", "choice",
        "SGLang plugin: `device` (holder pools by CUDA IPC, CUDA graphs on), `host` (gRPC), or "
        "`auto` (device when a holder shares its pool with this GPU)",
        default="auto", choices=SGLANG_PATHS),
    Var("CORPUSD_SGLANG_WINDOW", "int",
        "SGLang plugin, device path: the longest corpus one decode step scores (tokens)",
        default="16384", low=1),
    Var("CORPUSD_SGLANG_ARENA", "int",
        "SGLang plugin, device path: index-key arena for every bound corpus (tokens)",
        default="65536", low=1),
    Var("CORPUSD_SGLANG_PRIMITIVE", "choice",
        "SGLang plugin, host path: `route` or `fetch` per layer and holder group by the cost "
        "model (`auto`), or forced (`route`, `fetch`)",
        default="auto", choices=SGLANG_PRIMITIVES,
        check=lambda v: _LOCAL if v == "local" else ""),
    Var("CORPUSD_SGLANG_PAGE_CACHE_MB", "int",
        "SGLang plugin, host path: GPU page cache for fetched corpus pages, all layers "
        "(0: no fetch)",
        default="256", low=0,
        expect="the fetch page cache's size in MB, a whole number >= 0 (0: no cache, fetch off)"),
    Var("CORPUSD_SGLANG_TABLE_REFRESH_S", "float",
        "SGLang plugin, host path: re-read each bound corpus's page table this often (seconds), "
        "so running requests follow load replicas; `0`: the coordinator's lease / 3; `-1`: never",
        default="0", shown="the coordinator's lease / 3 (10 / 3 s if it does not say)",
        low=0, also=(-1.0,),
        expect="seconds between re-reads of a bound corpus's page table, a number > 0; 0 or "
        "unset: the coordinator's lease / 3; -1: never"),
    Var("CORPUSD_SGLANG_HOLDER_DEADLINE_S", "float",
        "SGLang plugin, host path: a decode step's call to a holder that has answered that shape "
        "before waits this long per 256 query rows; past it, one that does not answer a health "
        "check within 0.5 s counts as failed and its rows fail over (replica, page store, "
        "local); `0`: no deadline but the call timeout",
        default="1", low=0,
        expect="seconds, a number >= 0 (0: only the 60 s call timeout)"),
    Var("CORPUSD_SGLANG_HOLDER_PROBE_S", "float",
        "SGLang plugin, device path: ask each holder mapped on this GPU whether it is alive this "
        "often (seconds); one that misses two health checks in a row is failed over before the "
        "next step (its pages read from live replicas); `0`: never",
        default="0.25", low=0,
        expect="seconds between health checks of the mapped holders, a number >= 0 (0: never)"),
    Var("CORPUSD_SGLANG_PEER", "bool",
        "SGLang plugin, device path: also map the pools of holders on other GPUs of this host "
        "that this GPU reaches by peer access (NVLink), read in place inside the decode graphs; "
        "the server must see those GPUs (`CUDA_VISIBLE_DEVICES`); `0`: only its own GPU's",
        default="1"),
    Var("CORPUSD_SGLANG_STAGE_ROWS", "int",
        "SGLang plugin, device path, with a holder on another GPU: each layer copies the rows "
        "its query rows selected, this many query rows at a time, into one buffer on this GPU "
        "(a row crosses NVLink once), then attends them in one kernel call; `0`: read in "
        "place, a call per holder",
        default="64", low=0,
        expect="query rows per staging copy, a whole number >= 0 (0: read peer pools in place)"),
    Var("CORPUSD_SGLANG_ONE_CALL", "bool",
        "SGLang plugin, device path, bf16 cache with `flashmla_sparse`: attend a layer's own "
        "tokens and its corpus rows in one FlashMLA call over one staged buffer (the corpus rows "
        "in SGLang's layout), as stock attends them, instead of SGLang's call, a corpus call "
        "and an LSE merge; not yet run on a GPU",
        default="0"),
    Var("CORPUSD_SGLANG_PROFILE", "path",
        "SGLang plugin: the calibration profile (`corpusd calibrate`) its predicate uses",
        shown="`$CORPUSD_HOME/profile.json` if present",
        check=lambda p: "" if p.is_file() else "no such file"),
    Var("CORPUSD_SGLANG_METRICS_PORT", "int",
        "SGLang plugin: serve its Prometheus metrics (decisions, measured/predicted cost, page "
        "cache) on this loopback port",
        shown="unset: not served", low=1, high=65535, expect="a TCP port, 1-65535"),
    Var("CORPUSD_SGLANG_TRACE", "path",
        "SGLang plugin: append every route/fetch decision with its costs to this JSON-lines file",
        shown="unset"),
    Var("CORPUSD_SGLANG_PROFILE_SLOW", "float",
        "SGLang plugin: profile each bound prefill on the host (cProfile), wait for it, and log "
        "one that takes over this many seconds (1 if not a positive number) with its GPU time "
        "and profile, and log every Triton compile (a diagnosis aid; it slows prefills)",
        shown="unset", parse=_slow_seconds),
    Var("CORPUSD_SGLANG_DUMP", "path",
        "SGLang, a diagnosis aid (tools/diag_layer_diff.py): write the last row per forward and "
        "layer (indexer selection and scores, attention output, hidden state) of each request "
        "whose rid contains 'diag' to this directory; read by the plugin and by the stock dump "
        "package (SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang.stockdump); slows every forward",
        shown="unset"),
)  # fmt: skip
VARS: dict[str, Var] = {v.name: v for v in VARIABLES}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of ``name`` in ``environ`` (default: this process's environment): its
    default when unset or blank (None for a variable without one). Raises KeyError for a name
    not in the registry, EnvError (a ValueError) naming the variable for a bad value."""
    var = VARS.get(name)
    if var is None:
        raise KeyError(f"{name} is not a corpusd variable (corpusd/env.py declares them)")
    return var.value((os.environ if environ is None else environ).get(name))


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set to something other than blanks (its default does not count)."""
    assert name in VARS, f"{name} is not a corpusd variable"
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def markdown() -> str:
    """The README's table of :data:`VARIABLES` (one row each: name, type, meaning, default)."""
    rows = ["| variable | type | meaning | default |", "|---|---|---|---|"]
    for v in VARIABLES:
        kind = "/".join(v.choices) if v.kind == "choice" else v.kind
        shown = v.shown or (f"`{v.default}`" if v.default is not None else "unset")
        rows.append(f"| `{v.name}` | {kind} | {v.help} | {shown} |")
    return "\n".join(rows) + "\n"


#: The one wording for "no coordinator was found", wherever a command needs one.
NO_COORDINATOR = (
    "no coordinator: start `corpusd up`, pass --coordinator HOST:PORT or set $CORPUSD_COORDINATOR"
)
#: How every --coordinator flag's default is found (see ``coordinator``).
COORDINATOR_DEFAULT = "$CORPUSD_COORDINATOR, else the running `corpusd up`'s (its up.json)"


def calibrate_mode(flag: str = "") -> str:
    """``corpusd up``'s calibration: the flag, else $CORPUSD_CALIBRATE, else auto. Raises
    ValueError for another value."""
    if not flag:
        mode: str = get("CORPUSD_CALIBRATE")
        return mode
    if flag not in CALIBRATE_MODES:
        raise ValueError(f"--calibrate: {flag!r}; one of {', '.join(CALIBRATE_MODES)}")
    return flag


def home() -> Path:
    path: Path = get("CORPUSD_HOME")
    return path


def default_model_dir() -> Path:
    path: Path | None = get("CORPUSD_MODEL")
    return path if path is not None else home() / "models" / "tiny"


def default_store_dir() -> Path:
    path: Path | None = get("CORPUSD_STORE")
    return path if path is not None else home() / "store"


def coordinator(flag: str) -> str:
    """The coordinator address: the flag, else $CORPUSD_COORDINATOR, else the one a running
    ``corpusd up`` started (its ``up.json``), else ""."""
    return coordinator_source(flag)[0]


def coordinator_source(flag: str) -> tuple[str, str]:
    """``(address, where it came from)`` as ``coordinator`` resolves it; with no address,
    ``("", why there is none)``."""
    if flag:
        return flag, "--coordinator"
    address: str | None = get("CORPUSD_COORDINATOR")
    if address:
        return address, "$CORPUSD_COORDINATOR"
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m corpusd.env", description=__doc__)
    p.add_argument("--markdown", action="store_true", help="print the README's table")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(), end="")
        return 0
    for v in VARIABLES:  # each variable's value here, or the error it would raise
        try:
            value = "***" if v.name == "CORPUSD_TOKEN" and is_set(v.name) else get(v.name)
        except EnvError as e:
            value = f"error: {e}"
        print(f"{v.name}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
