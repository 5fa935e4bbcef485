"""``python -m tools.bench_gpu``'s arguments: ``--step-agents`` takes agent counts, refuses the
rest with a precise message (the bench itself needs two GPUs)."""

from __future__ import annotations

import argparse

import pytest

from tools.bench_gpu import agents_list


def test_step_agents_take_comma_separated_counts() -> None:
    assert agents_list("32") == (32,)
    assert agents_list("32,64,128") == (32, 64, 128)


@pytest.mark.parametrize("bad", ["", "32,", "x", "0", "32,5000", "-4"])
def test_step_agents_refuse_what_is_not_a_count(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
        agents_list(bad)
