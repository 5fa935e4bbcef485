"""Write tools/deploy/grafana-corpusd.json: the Grafana dashboard of a corpusd deployment.

Rows: holders (fan-in against the elbow, queue depth, partial time, bytes), the coordinator
(placements, queue, leases, leadership, load replicas) and requesters (route / fetch / local
decisions, measured over predicted cost, fallbacks, inter-token latency). Every query uses
metric names the daemons declare (tests/unit/test_deploy.py checks them).

    python -m tools.deploy.make_dashboard      # rewrites the JSON beside this file
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("grafana-corpusd.json")
Q = "histogram_quantile({q}, sum by (le, instance) (rate({m}_bucket[1m])))"


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short") -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def panels() -> list[dict[str, Any]]:
    h, c, r = "corpusd_holder_", "corpusd_coordinator_", "corpusd_requester_"
    return [
        row("Holders"),
        panel(
            "Fan-in vs elbow",
            [
                (f"{h}flows_active + {h}queue_depth", "{{instance}} fan-in"),
                (f"{h}elbow_flows", "{{instance}} elbow"),
            ],
        ),
        panel("Queue depth", [(f"{h}queue_depth", "{{instance}}")]),
        panel(
            "Partial-attention time",
            [
                (Q.format(q=0.5, m=f"{h}partial_seconds"), "{{instance}} p50"),
                (Q.format(q=0.99, m=f"{h}partial_seconds"), "{{instance}} p99"),
            ],
            "s",
        ),
        panel(
            "Queue wait",
            [(Q.format(q=0.99, m=f"{h}queue_wait_seconds"), "{{instance}} p99")],
            "s",
        ),
        panel(
            "Bytes",
            [
                (f"sum by (instance) (rate({h}bytes_in_total[1m]))", "{{instance}} in"),
                (f"sum by (instance) (rate({h}bytes_out_total[1m]))", "{{instance}} out"),
                (f"{h}bytes_resident", "{{instance}} resident"),
            ],
            "Bps",
        ),
        row("Coordinator"),
        panel(
            "Placements",
            [(f"sum by (outcome) (increase({c}pins_total[5m]))", "{{outcome}}")],
        ),
        panel(
            "Publish time",
            [(Q.format(q=0.5, m=f"{c}publish_seconds"), "p50")],
            "s",
        ),
        panel("Pin queue", [(f"{c}queue_depth", "{{instance}}")]),
        panel("Holders by lease", [(f"{c}holders", "{{instance}} {{lease}}")]),
        panel(
            "Fan-in per holder (heartbeats) vs elbow",
            [
                (f"max by (holder) ({c}holder_active_flows)", "{{holder}} fan-in"),
                (f"max by (holder) ({c}holder_elbow_flows)", "{{holder}} elbow"),
            ],
        ),
        panel(
            "Leadership",
            [
                (f"{c}leader", "{{instance}} leads"),
                (f"increase({c}leader_changes_total[10m])", "{{instance}} became leader"),
            ],
        ),
        panel(
            "Load replicas",
            [(f"sum by (action) (increase({c}load_replicas_total[10m]))", "{{action}}")],
        ),
        row("Requesters"),
        panel(
            "Route / fetch / local",
            [(f"sum by (primitive) (rate({r}decisions_total[1m]))", "{{primitive}}")],
        ),
        panel(
            "Measured / predicted cost",
            [
                (
                    f"sum by (primitive) (rate({r}measured_seconds_sum[5m])) / "
                    f"sum by (primitive) (rate({r}predicted_seconds_sum[5m]))",
                    "{{primitive}} (5 m)",
                ),
                (f"{r}last_measured_over_predicted", "{{instance}} {{primitive}} last"),
            ],
        ),
        panel(
            "Fallbacks",
            [(f"sum by (from, to) (rate({r}fallbacks_total[5m]))", "{{from}} → {{to}}")],
        ),
        panel(
            "Replicated pages: holder speed weights (mean 1) and re-spreads",
            [
                (f"{r}replica_weight", "{{instance}} {{holder}}"),
                (f"sum(rate({r}replica_rebalances_total[5m]))", "re-spreads/s"),
            ],
        ),
        panel(
            "SGLang plugin: route / fetch by layer",
            [
                (
                    f"sum by (primitive, layer) (rate({r}sglang_group_decisions_total[1m]))",
                    "layer {{layer}} {{primitive}}",
                )
            ],
        ),
        panel(
            "SGLang plugin: fetch page cache",
            [
                (
                    f'sum(rate({r}sglang_page_cache_lookups_total{{result="hit"}}[5m])) / '
                    f"sum(rate({r}sglang_page_cache_lookups_total[5m]))",
                    "hit ratio",
                ),
                (f"{r}sglang_page_cache_pages", "{{instance}} pages"),
            ],
        ),
        panel(
            "Inter-token latency",
            [
                (Q.format(q=0.5, m=f"{r}inter_token_seconds"), "{{instance}} p50"),
                (Q.format(q=0.99, m=f"{r}inter_token_seconds"), "{{instance}} p99"),
            ],
            "s",
        ),
    ]


def dashboard() -> dict[str, Any]:
    ps = panels()
    y, col = 0, 0
    for i, p in enumerate(ps):  # a row spans the width; panels go three to a line under it
        if p["type"] == "row":
            y += 8 if i else 0
            p["gridPos"] = {"x": 0, "y": y, "w": 24, "h": 1}
            y, col = y + 1, 0
        else:
            if col == 3:
                y, col = y + 8, 0
            p["gridPos"] = {"x": 8 * col, "y": y, "w": 8, "h": 8}
            col += 1
        p["id"] = i + 1
    return {
        "title": "corpusd",
        "uid": "corpusd",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
            ]
        },
        "panels": ps,
    }


def main() -> None:
    OUT.write_text(json.dumps(dashboard(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
