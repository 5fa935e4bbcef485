"""Skip reasons and metric reads shared by every tier (the comparison ``rel`` is
``corpusd.testing.numeric``'s)."""

from __future__ import annotations

import importlib.util
import re
import urllib.request

import torch


def why_no_sglang_gpu() -> str:
    """Why the ``sglang`` tests cannot run here, or "" when they can: they need sglang installed
    and an SM90 GPU (FlashMLA's sparse kernels, which the NSA backend runs)."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install 'corpusd[sglang]', or .sglang-deps/)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"FlashMLA sparse needs SM90; this is SM{torch.cuda.get_device_capability()}"
    return ""


def metric(port: int, name: str, *labels: str) -> float:
    """The sum of ``name``'s samples whose labels contain every one of ``labels``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(v) for lab, v in found if all(x in lab for x in labels))
