"""Tokenizers: the model directory's ``tokenizer.json`` when present, else built-in byte-level.

The byte-level tokenizer maps each UTF-8 byte to its value (0–255) and reserves ids for BOS and
EOS above them; it needs no files and no network, which is what the embedded default runs on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BOS_ID = 256
EOS_ID = 257
BYTE_VOCAB_SIZE = 320  # 256 bytes + specials, rounded up to a multiple of 64


class Tokenizer(Protocol):
    name: str
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    name = "corpusd-bytes-v1"
    bos_id: int | None = BOS_ID
    eos_id: int | None = EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library (no special tokens added)."""

    def __init__(self, path: Path, bos_id: int | None, eos_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.name = f"tokenizer.json:{path.stat().st_size}"
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def load_tokenizer(model_dir: str | Path, bos_id: int | None, eos_id: int | None) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path, bos_id, eos_id)
    return ByteTokenizer()
