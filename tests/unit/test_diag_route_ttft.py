"""``tools/diag_route_ttft`` reads two kinds of log line: the plugin's slow-prefill line (its
format string, ``metrics.SLOW_PREFILL_LOG``) and SGLang's "Prefill batch" line (as an SGLang
0.5.10 server wrote it on an H100, ``bench/results/logs/sglang-graphs64-h100-route.log``)."""

from __future__ import annotations

import logging
from pathlib import Path

from requester.sglang.metrics import SLOW_PREFILL_LOG
from tools.diag_route_ttft import log_facts

ROOT = Path(__file__).resolve().parents[2]


def test_log_facts_reads_the_plugins_slow_prefills_and_sglangs_prefill_batches(
    tmp_path: Path,
) -> None:
    sglang_lines = [
        ln
        for ln in (ROOT / "bench/results/logs/sglang-graphs64-h100-route.log")
        .read_text(errors="replace")
        .splitlines()
        if "Prefill batch" in ln
    ]
    assert sglang_lines, "the recorded SGLang log has prefill batches"
    record = logging.LogRecord("corpusd.sglang", logging.WARNING, "", 0, SLOW_PREFILL_LOG,
                               (2118, 43, 0.034, 33.7, 33.8), None)  # fmt: skip
    plugin_line = f"[2026-11-26 08:53:15] {record.getMessage()}"
    log = tmp_path / "server.log"
    log.write_text("\n".join(["server started", plugin_line, *sglang_lines[-2:]]) + "\n")
    facts = log_facts(log, since=1)
    assert facts["bound_prefills_over_threshold"] == [
        {"tokens": 2118, "requests": 43, "host_s": 0.03, "gpu_ms": 33.7, "wall_ms": 33.8}
    ]
    batches = facts["prefill_batches"]
    assert len(batches) == 2 and all(b["seqs"] >= 1 and b["new"] >= 64 for b in batches)
    assert log_facts(log, since=2)["bound_prefills_over_threshold"] == []  # lines after `since`
