"""Import before any Triton kernel module when running under ``TRITON_INTERPRET=1``.

Triton ≤ 3.5's interpreter calls ``int()`` on one-element numpy arrays, an error since numpy 2.4;
its tensors get an ``__index__`` that reads the element. Later Triton passes the patch hook more
arguments (a scope), which are forwarded unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import triton.runtime.interpreter as interp

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

_orig = interp._patch_lang_tensor


def _patch(tensor: type, *args: Any, **kwargs: Any) -> None:
    _orig(tensor, *args, **kwargs)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])  # type: ignore


interp._patch_lang_tensor = _patch
