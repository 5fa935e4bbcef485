"""A pinned corpus's manifest: what it is, how it was made, and the checksums of its files."""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from corpusd.kernels.formats import KV_FORMATS, ROW_BYTES

if TYPE_CHECKING:
    import torch

FORMAT = "corpusd-pages-v1"
#: Tokens per page: the one default of every role (pin, holder, SGLang page hashes). A holder
#: loads, and an SGLang server binds, only corpora pinned with its own page size.
PAGE_SIZE = 64
STATES = ("pinning", "ready", "retired")
# How latent rows are stored (``KV_FORMATS``, from ``corpusd/kernels/formats.py``): "plain" rows
# of ``kv_dim`` values in the manifest's dtype, or FlashMLA's 656-byte fp8 rows (``ROW_BYTES``;
# index keys stay in the dtype).


def page_format(dtype: str, kv_format: str) -> str:
    """What a holder must hold to load a corpus: its dtype, with ``+fp8_e4m3`` for fp8 rows
    ("float32", "bfloat16", "bfloat16+fp8_e4m3"). A plain corpus's string is its dtype alone,
    so the ids of corpora pinned before formats existed do not change."""
    assert kv_format in KV_FORMATS, f"{kv_format=}"
    return dtype if kv_format == "plain" else f"{dtype}+{kv_format}"


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything DESIGN.md's data model lists for a corpus, as stored in ``manifest.json``.

    ``files`` holds ``(path, start, end)`` token spans; ``skipped`` holds ``(path, reason,
    detail)``; ``checksums`` maps each data file of the corpus directory to ``sha256:<hex>``;
    ``page_digests`` holds one hex digest per page (``store.page_digest``: BLAKE2b-128 over the
    page's bytes in every layer), so a holder checks exactly the pages it loads. A manifest
    written before page digests existed has none; its files are checked whole instead.
    ``kv_format`` says how latent rows are stored (``KV_FORMATS``); ``kv_dim`` stays the logical
    row width (576) either way. ``engine`` is empty for corpusd's own prefill; a pin made by a
    serving engine (``corpusd pin --engine``) records it there: ``marker`` (e.g.
    ``sglang-0.5.10.post1``, also hashed into the corpus id), URL, model path, page size, kv
    cache dtype, host layout.
    """

    corpus_id: str
    name: str
    state: str
    source_kind: str
    source_digest: str
    token_count: int
    page_size: int
    n_pages: int
    n_layers: int
    kv_dim: int
    index_dim: int
    dtype: str
    model_fingerprint: str
    tokenizer: str
    replicas: int = 1
    files: tuple[tuple[str, int, int], ...] = ()
    skipped: tuple[tuple[str, str, str], ...] = ()
    checksums: dict[str, str] = field(default_factory=dict)
    page_digests: tuple[str, ...] = ()
    created_at: str = ""
    prefill_seconds: float = 0.0
    format: str = FORMAT
    kv_format: str = "plain"
    engine: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.state in STATES, f"{self.state=}"
        assert self.kv_format in KV_FORMATS, f"{self.kv_format=} is not one of {KV_FORMATS}"
        assert self.n_pages == -(-self.token_count // self.page_size), (
            f"{self.n_pages=} for {self.token_count=} {self.page_size=}"
        )
        assert not self.page_digests or len(self.page_digests) == self.n_pages, (
            f"{len(self.page_digests)=} for {self.n_pages=}"
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: the manifest is read by commands that never load a tensor

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def page_format(self) -> str:
        return page_format(self.dtype, self.kv_format)

    @property
    def latent_width(self) -> int:
        """Elements of one stored latent row: ``kv_dim``, or 656 bytes for fp8 rows."""
        return self.kv_dim if self.kv_format == "plain" else ROW_BYTES

    @property
    def token_layer_bytes(self) -> int:
        """Stored bytes per token and layer: its latent row and its index key."""
        elt = 4 if self.dtype == "float32" else 2
        latent = self.kv_dim * elt if self.kv_format == "plain" else ROW_BYTES
        return latent + self.index_dim * elt

    @property
    def latent_dtype(self) -> torch.dtype:
        """The stored latent rows' dtype: ``torch_dtype``, or uint8 for fp8 rows."""
        import torch

        return self.torch_dtype if self.kv_format == "plain" else torch.uint8

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse ``manifest.json``. Raises ValueError saying what is wrong: not JSON, another
        format, a missing, unknown or mistyped field, inconsistent counts."""
        try:
            d: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"manifest is a JSON {type(d).__name__}, not an object")
        if d.get("format") != FORMAT:
            raise ValueError(f"manifest format {d.get('format')!r} is not {FORMAT!r}")
        try:
            d["files"] = tuple(tuple(x) for x in d.get("files", ()))
            d["skipped"] = tuple(tuple(x) for x in d.get("skipped", ()))
            d["page_digests"] = tuple(d.get("page_digests", ()))
        except TypeError as e:
            raise ValueError(f"manifest: {e}") from None
        unknown = sorted(set(d) - _FIELDS.keys())
        if unknown:
            raise ValueError(f"manifest has unknown fields {unknown}")
        for name, value in d.items():
            if not isinstance(value, _FIELDS[name]) or isinstance(value, bool):
                raise ValueError(f"manifest field {name!r} is {value!r:.60}, not {_FIELDS[name]}")
        try:
            return cls(**d)
        except (TypeError, AssertionError) as e:
            raise ValueError(f"manifest: {e}") from None


#: the JSON type of each field, checked on parse (a mistyped field fails there, not later)
_SCALARS: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str}
_FIELDS: dict[str, type | tuple[type, ...]] = {
    f.name: _SCALARS.get(str(f.type), dict if str(f.type).startswith("dict") else tuple)
    for f in fields(Manifest)
}


def corpus_id(tokens: tuple[int, ...], model_fingerprint: str, page_size: int, dtype: str) -> str:
    """Content address of a corpus: 128 bits of sha256 over what determines its pages."""
    h = hashlib.sha256(f"{FORMAT}|{model_fingerprint}|{page_size}|{dtype}|".encode())
    ids = array("i", tokens)  # int32, little-endian: the bytes torch.int32 had (torch-free)
    assert ids.itemsize == 4 and sys.byteorder == "little", f"{ids.itemsize=} {sys.byteorder=}"
    h.update(ids.tobytes())
    return h.hexdigest()[:32]
