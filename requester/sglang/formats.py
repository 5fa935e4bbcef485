"""Which KV formats an SGLang worker and corpusd's holders pair with, checked and said at start.

Two formats meet in one attention: the worker's own pages (SGLang's ``--kv-cache-dtype``,
``bfloat16`` or ``fp8_e4m3`` for DeepSeek's NSA) and the corpus's pages on the holders (the pin's
``--kv-format``: ``plain`` rows in the holders' dtype, or ``fp8_e4m3``, FlashMLA's 656-byte rows).
Each part is exact for its own pages and the two merge by LSE, so every pairing is a valid
attention; only a matched pair attends the corpus as stock SGLang of that ``--kv-cache-dtype``
attends a prompt's pages (same rows, same FlashMLA kernel), so only a matched pair is compared
with stock. A mixed pair is served, with a warning that says which stock run it will not equal.

The backends: the plugin keeps the LSE of FlashMLA's two kernels only (``flashmla_sparse``,
``flashmla_kv``), and SGLang's fp8 cache is read by ``flashmla_kv`` alone in decode
(``flashmla_sparse`` decode hands the fp8 buffer to the bf16 sparse kernel).
"""

from __future__ import annotations

import logging
from typing import Any

from corpusd.formats import KV_FORMATS

log = logging.getLogger("corpusd.sglang")

PLAIN, FP8 = KV_FORMATS
PREFILL_BACKENDS = ("flashmla_sparse", "flashmla_kv", "flashmla_auto")
DECODE_BACKENDS = ("flashmla_sparse", "flashmla_kv")


def model_dtype(flag: str, config: Any) -> str:
    """The dtype SGLang 0.5.10 runs the model in: ``--dtype``, or with ``auto`` the checkpoint's
    ``torch_dtype`` (a float32 or unstated one runs in float16, as its ``_get_and_verify_dtype``
    does for non-Gemma models)."""
    if flag != "auto":
        return flag
    got = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32")
    got = got.removeprefix("torch.")
    return "float16" if got == "float32" else got


def worker_format(
    kv_cache_dtype: str, kv_quant_algo: object = None, dtype: str = "bfloat16"
) -> str:
    """SGLang's ``kv_cache_dtype`` → ``plain`` or ``fp8_e4m3``. Raises RuntimeError for a dtype
    SGLang's NSA does not store.

    ``auto`` is resolved as SGLang 0.5.10 does: its server arguments turn it into bfloat16 or
    fp8_e4m3 only for the architectures they list (``DeepseekV32ForCausalLM`` is not among them,
    so the model sees ``auto``), and the model runner then takes FP8 when the checkpoint's
    quantization config says ``kv_cache_quant_algo: FP8``, else the model's ``dtype``."""
    if kv_cache_dtype == "auto":
        if isinstance(kv_quant_algo, str) and kv_quant_algo.upper() == "FP8":
            return FP8
        if dtype in ("bfloat16", "bf16", "torch.bfloat16"):
            return PLAIN
        raise RuntimeError(
            f"corpusd plugin: --kv-cache-dtype auto gives a {dtype} cache; DeepSeek's NSA stores "
            "bfloat16 or fp8_e4m3 pages, pass --kv-cache-dtype bfloat16 or fp8_e4m3"
        )
    if kv_cache_dtype in ("bfloat16", "bf16"):
        return PLAIN
    if kv_cache_dtype == FP8:
        return FP8
    raise RuntimeError(
        f"corpusd plugin: --kv-cache-dtype {kv_cache_dtype!r}; DeepSeek's NSA stores bfloat16 or "
        "fp8_e4m3 pages, pass one of them"
    )


def holder_format(page_format: str) -> str:
    """A holder's registered page format (``"bfloat16"``, ``"bfloat16+fp8_e4m3"``, …) → its row
    format."""
    return FP8 if page_format.endswith("+" + FP8) else PLAIN


def check_backends(worker: str, prefill: str | None, decode: str | None) -> None:
    """Raise RuntimeError, naming the flag, for NSA backends the plugin cannot serve with a
    worker cache of format ``worker``."""
    if prefill not in PREFILL_BACKENDS:
        raise RuntimeError(
            f"corpusd plugin: --nsa-prefill-backend {prefill}; it keeps the LSE of "
            f"{', '.join(PREFILL_BACKENDS)} only"
        )
    if decode not in DECODE_BACKENDS:
        raise RuntimeError(
            f"corpusd plugin: --nsa-decode-backend {decode}; it keeps the LSE of "
            f"{', '.join(DECODE_BACKENDS)} only"
        )
    if worker == FP8 and decode != "flashmla_kv":
        raise RuntimeError(
            "corpusd plugin: --kv-cache-dtype fp8_e4m3 needs --nsa-decode-backend flashmla_kv "
            "(SGLang's flashmla_sparse decode reads bf16 pages only)"
        )


def pairing(worker: str, holders: dict[str, str]) -> tuple[int, str]:
    """The log level and line for a worker cache of format ``worker`` with ``holders`` (address
    → row format). Every pairing is served; a mixed one warns."""
    by_format: dict[str, list[str]] = {}
    for address, fmt in sorted(holders.items()):
        by_format.setdefault(fmt, []).append(address)
    said = "; ".join(f"{f} rows on {', '.join(a)}" for f, a in sorted(by_format.items()))
    if not holders:
        return logging.INFO, f"corpusd plugin: worker KV cache {worker}; no holders registered yet"
    others = sorted(set(by_format) - {worker})
    if not others:
        return logging.INFO, (
            f"corpusd plugin: worker KV cache {worker}, corpus pages {said}: the corpus is "
            f"attended as stock SGLang with this --kv-cache-dtype attends a prompt's own pages"
        )
    return logging.WARNING, (
        f"corpusd plugin: worker KV cache {worker}, corpus pages {said}: served (each part is "
        f"exact for its pages), but the corpus part is computed from {'/'.join(others)} rows, "
        f"so answers match neither stock SGLang with {worker} pages nor with {others[0]} pages; "
        f"pin with --kv-format {worker} for the worker's numbers"
    )


def log_pairing(worker: str, holders: dict[str, str]) -> None:
    level, line = pairing(worker, holders)
    log.log(level, line)
