"""tools/decode_log_steps.py: a decode step's time by batch size from SGLang's Decode batch
lines (the step times benchmarks.md quotes from the share runs' worker logs)."""

from __future__ import annotations

from tools.decode_log_steps import steps


def _decode(running: int, tok_s: float) -> str:
    """One of SGLang's Decode batch lines, as 0.5.10 writes it."""
    return (
        f"[2026-11-28 21:52:44] Decode batch, #running-req: {running}, #token: 128, token usage: "
        f"0.00, cuda graph: True, gen throughput (token/s): {tok_s:.2f}, #queue-req: 0\n"
    )


LOG = (
    _decode(8, 3200)
    + "[2026-11-28 21:52:45] Prefill batch, #new-seq: 2, #new-token: 128, #cached-token: 0\n"
    + _decode(8, 3300)
    + _decode(8, 100)
    + _decode(128, 8873)
)


def test_step_time_is_the_batch_over_the_median_throughput_of_its_lines() -> None:
    got = steps(LOG)
    assert list(got) == [8]  # batch 128 has one line, under the default threshold of 3
    assert got[8] == {"lines": 3, "tok_s": 3200.0, "step_ms": 2.5}
    assert steps(LOG, min_lines=1)[128]["step_ms"] == round(1e3 * 128 / 8873, 2)
