"""The Triton index-score kernel against ``indexer.index_scores``, in Triton's CPU interpreter."""

from __future__ import annotations

from tests.support.interpreted import run_interpreted


def test_triton_scores_interpreted_match_reference() -> None:
    """``tests/support/triton_scores_interpreted.py``: exact and fp8 arithmetic, causal masks,
    odd head counts and widths, 1 to 64 rows per program."""
    run_interpreted("triton_scores_interpreted.py")
