"""The device path's Triton kernels (``requester/sglang/device_triton.py``) in Triton's CPU
interpreter, against the torch ops they replace."""

from tests.support.interpreted import run_interpreted


def test_device_path_kernels_interpreted_match_the_torch_ops() -> None:
    """``tests/support/device_triton_interpreted.py``: the fused top-k's keys and split (ties,
    ±0, NaN, -inf, short and unbound rows), positions → holder frames, the LSE merge."""
    run_interpreted("device_triton_interpreted.py")
