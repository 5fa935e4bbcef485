"""Test helpers: damage a page store the way a disk or a stray write would."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from corpusd.corpus.store import layer_file


def page_offset(store: Path, corpus_id: str, layer: int, page: int, tensor: str = "latent") -> int:
    """Byte offset in ``layer_NNN.safetensors`` of the first byte of ``page`` of ``tensor``
    ("latent" or "index_keys"), read from the file's own header."""
    path = store / "corpora" / corpus_id / layer_file(layer)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])[tensor]
    shape = entry["shape"]
    elt = torch.empty(
        (), dtype=getattr(torch, {"F32": "float32", "BF16": "bfloat16"}[entry["dtype"]])
    )
    page_bytes = shape[1] * shape[2] * elt.element_size()
    return 8 + n + entry["data_offsets"][0] + page * page_bytes


def flip_byte(path: Path, offset: int) -> None:
    """XOR one byte of ``path`` with 0x01 (twice restores it)."""
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def flip_page(
    store: Path, corpus_id: str, layer: int, page: int, tensor: str = "latent", at: int = 5
) -> None:
    """Flip byte ``at`` of one stored page (call again to restore it)."""
    path = store / "corpora" / corpus_id / layer_file(layer)
    flip_byte(path, page_offset(store, corpus_id, layer, page, tensor) + at)
