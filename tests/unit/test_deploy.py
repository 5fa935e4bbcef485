"""tools/deploy: the Grafana dashboard and the Prometheus alert rules parse, and every metric they
query is one the daemons declare (their registries, as /metrics serves them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.registry import CollectorRegistry

from corpusd.coordinator.metrics import CoordinatorMetrics
from holder.metrics import HolderMetrics
from requester.metrics import RequesterMetrics
from requester.sglang.metrics import PluginMetrics
from tools.deploy.make_dashboard import dashboard

DEPLOY = Path(__file__).resolve().parents[2] / "tools" / "deploy"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}


def names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of ``registry`` can show."""
    out = set()
    for fam in registry.collect():
        out |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
    return out


def declared() -> set[str]:
    coord = CoordinatorMetrics()
    coord.watch_state(lambda: ([], {}, {}, True, {}))
    roles = (coord, HolderMetrics(), RequesterMetrics(), PluginMetrics())  # the SGLang plugin's
    return set().union(*(names(m.registry) for m in roles))


def used(expr: str) -> set[str]:
    return set(re.findall(r"\bcorpusd_[a-z0-9_]+", expr))


def test_dashboard_queries_only_declared_metrics_and_is_the_generators_output() -> None:
    board = json.loads((DEPLOY / "grafana-corpusd.json").read_text())
    assert board == json.loads(json.dumps(dashboard())), "run python -m tools.deploy.make_dashboard"
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    have = declared()
    missing = {(n, e) for e in exprs for n in used(e) if n not in have}
    assert not missing, missing
    titles = {p["title"] for p in board["panels"]}
    for want in ("Fan-in vs elbow", "Pin queue", "Route / fetch / local", "Load replicas"):
        assert want in titles
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_alert_rules_parse_and_query_only_declared_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"][0]["rules"]
    have = declared()
    for r in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= set(r), r
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        assert used(r["expr"]) and used(r["expr"]) <= have, (r["alert"], used(r["expr"]) - have)
    alerts = {r["alert"] for r in rules}
    assert {"CorpusdHolderPastElbow", "CorpusdHolderLeaseLost", "CorpusdPinQueueGrowing",
            "CorpusdPredicateBadlyOff"} <= alerts  # fmt: skip


def test_a_misspelt_metric_would_be_caught() -> None:
    assert "corpusd_holder_flows_active" in declared()
    assert "corpusd_holder_flow_active" not in declared()
    assert "corpusd_coordinator_pins_total" in declared()
