"""``PinConfig``: one pin's settings, the flags of ``corpusd pin`` (torch-free, so the CLI
builds its parser without importing the model)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from corpusd.corpus.manifest import PAGE_SIZE
from corpusd.daemon_config import positive
from corpusd.formats import KERNELS, KV_FORMATS

DTYPES = ("float32", "bfloat16")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class PinConfig:
    """One pin. ``model``/``store`` default to the embedded tiny model and ``$CORPUSD_HOME``."""

    corpus: str = field(metadata={"help": "a .tar, .tar.gz or a directory"})
    model: str | None = field(
        default=None,
        metadata={"help": "model directory (default: $CORPUSD_MODEL or the tiny model)"},
    )
    store: str | None = field(
        default=None, metadata={"help": "page store directory (default: $CORPUSD_STORE)"}
    )
    name: str | None = field(
        default=None, metadata={"help": "corpus name (default: the source's file name)"}
    )
    page_size: int = field(default=PAGE_SIZE, metadata={"help": "tokens per page"})
    max_tokens: int = field(default=1 << 20, metadata={"help": "refuse larger corpora"})
    max_file_bytes: int = field(default=1 << 20, metadata={"help": "skip larger files"})
    chunk: int = field(
        default=0,
        metadata={"help": "prefill chunk in tokens (default: 256 on CPU, 8192 on CUDA)"},
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "cache and prefill dtype (bfloat16 for GPU pins)", "choices": DTYPES},
    )
    kv_format: str = field(
        default="plain",
        metadata={
            "help": "latent page format: plain (rows in --dtype) or fp8_e4m3 (FlashMLA's "
            "656-byte rows, as SGLang's --kv-cache-dtype fp8_e4m3; kv_lora_rank 512, rope 64)",
            "choices": KV_FORMATS,
        },
    )
    device: str = field(
        default="cpu",
        metadata={"help": "where the prefill runs: cpu, cuda or cuda:N (pages are stored alike)"},
    )
    kernels: str = field(
        default="auto",
        metadata={
            "help": "prefill kernels: auto (on an SM90 GPU, Triton index scores and FlashMLA "
            "sparse attention; elsewhere torch) or torch (the references, any device)",
            "choices": KERNELS,
        },
    )
    engine: str | None = field(
        default=None,
        metadata={
            "help": "http://HOST:PORT of an SGLang server with the corpusd capture backend: it "
            "prefills the corpus and its pages are stored (dtype, format and page size are the "
            "server's; docs/sglang.md)"
        },
    )
    engine_timeout: float = field(
        default=600.0, metadata={"help": "seconds to wait for the engine's prefill and pages"}
    )

    @property
    def prefill_chunk(self) -> int:
        """``chunk``, or the device's default: larger GPU chunks amortise each layer's launches
        (SGLang's chunked prefill is 8,192 too; the indexer's ``[chunk, T]`` float32 scores are
        8 GiB at 8,192 × 256k)."""
        return self.chunk or (256 if self.device == "cpu" else 8192)

    def __post_init__(self) -> None:
        positive(self, "page_size", "max_tokens", "max_file_bytes", "engine_timeout")
        if self.chunk < 0:
            raise ValueError(f"chunk must be > 0 (or 0: the device's default), got {self.chunk}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
