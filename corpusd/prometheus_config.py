"""A Prometheus scrape config for a running ``corpusd up``, from its ``up.json``: one job per role
(``corpusd-coordinator``, ``corpusd-holder``, ``corpusd-agent``) whose targets are the daemons'
metrics ports on loopback. ``corpusd prometheus-config`` prints it (or writes it with ``--out``).

What a scraper must present on a metrics port of a secure ``up`` (``corpusd/daemon.py``'s
``listen`` serves it with prometheus_client's ``start_http_server`` and the TLS arguments of
``corpusd/security.py``'s ``serving``): TLS under ``up``'s CA (``<state>/tls/ca.pem``) and a
client certificate that chains to it (``up`` makes one pair, ``node.pem``/``node.key``, for its
daemons and local clients). No bearer token is checked there: tokens guard the gRPC and HTTP
API ports, so the config has no ``authorization`` block. ``up --insecure`` serves plaintext:
the config then says ``scheme: http`` and has no ``tls_config``.

Each target's ``instance`` label is the daemon's name as ``corpusd ps`` shows it
(``coordinator``, ``holder-0`` …, ``agent``), so the dashboard's legends and the alerts'
``{{ $labels.instance }}`` (tools/deploy) name the daemon rather than a port.

The ports are this ``up``'s: a later ``up`` picks free ones again unless it was started with
``--metrics-ports B``; then the config stays valid across restarts. A restart of one daemon by
``up``'s supervisor keeps its port. The etcd standby coordinator of ``up --state etcd``
(``coordinator-1``) has no metrics port in ``up.json``: it is read from the ``endpoint.json`` in
its directory, so both coordinators are scraped (``CorpusdNoLeader`` takes the max over them).

The text is YAML written here (the structure is small and fixed; no YAML package needed):
strings are JSON-quoted, which YAML reads as double-quoted scalars.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from corpusd.local_ca import LocalCA

#: role → Prometheus job name (prefixed: the jobs go into an operator's own prometheus.yml)
JOBS = {"coordinator": "corpusd-coordinator", "holder": "corpusd-holder", "agent": "corpusd-agent"}
SCRAPE_INTERVAL = "15s"
#: the directory (and ``corpusd ps`` name) of ``up --state etcd``'s standby coordinator
STANDBY = "coordinator-1"


def targets(info: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """``role → [(instance, host:port), …]`` of the metrics ports in ``up.json``'s ``info``
    (a daemon without one, ``metrics`` -1, is left out). Holders are named ``holder-<i>`` in
    ``up.json``'s order, as ``up`` names their directories; an etcd ``up``'s standby
    coordinator is ``coordinator-1``."""
    out: dict[str, list[tuple[str, str]]] = {role: [] for role in JOBS}
    named = [("coordinator", "coordinator", info["coordinator"])]
    if "," in str(info["coordinator"].get("address", "")):  # up --state etcd: and a standby
        named.append(("coordinator", STANDBY, {"metrics": _standby_port(info)}))
    named += [("holder", f"holder-{i}", h) for i, h in enumerate(info["holders"])]
    named.append(("agent", "agent", info["agent"]))
    for role, name, d in named:
        port = int(d.get("metrics", -1))
        if port >= 0:
            out[role].append((name, f"127.0.0.1:{port}"))
    return out


def _standby_port(info: dict[str, Any]) -> int:
    """The metrics port in the standby coordinator's ``endpoint.json`` (-1: none yet)."""
    path = Path(info["state_dir"]) / STANDBY / "endpoint.json"
    try:
        return int(json.loads(path.read_text()).get("metrics_port", -1))
    except (OSError, ValueError, AttributeError):
        return -1


def scrape_configs(info: dict[str, Any], interval: str = SCRAPE_INTERVAL) -> dict[str, Any]:
    """``{"scrape_configs": [...]}`` for the ``up`` of ``info`` (its ``up.json``): a job per
    role with targets, ``scheme`` and, when ``up`` serves TLS, ``tls_config`` with the absolute
    paths of its CA, certificate and key."""
    sec = info.get("security")
    jobs = []
    for role, found in targets(info).items():
        if not found:
            continue
        job: dict[str, Any] = {
            "job_name": JOBS[role],
            "scrape_interval": interval,
            "metrics_path": "/metrics",
            "scheme": "https" if sec else "http",
        }
        if sec:
            ca = LocalCA(Path(sec["dir"]).resolve())
            job["tls_config"] = {
                "ca_file": str(ca.ca),
                "cert_file": str(ca.cert),
                "key_file": str(ca.key),
            }
        # a static label sets `instance`; Prometheus derives it from the address only when unset
        job["static_configs"] = [
            {"targets": [address], "labels": {"instance": name}} for name, address in found
        ]
        jobs.append(job)
    return {"scrape_configs": jobs}


def render(info: dict[str, Any], interval: str = SCRAPE_INTERVAL) -> str:
    """:func:`scrape_configs` as a YAML document with a comment naming its ``up``."""
    head = [
        f"# Prometheus scrape config for the corpusd up in {info['state_dir']} "
        f"(pid {info['pid']}),",
        "# written by `corpusd prometheus-config`. Merge its scrape_configs into prometheus.yml,",
        "# or use it as it is; alert rules: rule_files: [tools/deploy/alerts.yml].",
    ]
    if info.get("security"):
        head.append("# Prometheus must run as a user that can read the key (mode 0600).")
    return "\n".join(head) + "\n" + to_yaml(scrape_configs(info, interval)) + "\n"


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _scalar(value: Any) -> str:
    return json.dumps(value)  # JSON scalars (and {} / []) are YAML flow scalars


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block YAML for nested dicts and lists of JSON scalars (no trailing newline)."""
    pad = "  " * indent
    lines = []
    if isinstance(value, dict):
        for k, v in value.items():
            key = k if _PLAIN_KEY.fullmatch(k) else json.dumps(k)
            if isinstance(v, (dict, list)) and v:
                lines += [f"{pad}{key}:", to_yaml(v, indent + 1)]
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)) and item:  # "- " then the item one level in
                lines.append(f"{pad}- " + to_yaml(item, indent + 1).lstrip())
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(pad + _scalar(value))
    return "\n".join(lines)
