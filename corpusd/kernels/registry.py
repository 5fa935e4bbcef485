"""Attention-partial kernels by name, and the one rule that chooses among them.

A kernel computes a :data:`~corpusd.kernels.reference.PartialOut` ``(O, LSE)`` of query rows over
pool rows (``partial_attention``'s contract: natural-log LSE, ``-inf`` and O = 0 for empty
rows), over plain rows or FlashMLA's fp8 rows (uint8 ``[N, 656]``, ``formats``) alike:

- ``torch``: the reference (``reference``, ``fp8_cache``), everywhere;
- ``triton``: ours (``triton_mla``, ``triton_fp8``), any head count, on a CUDA GPU with Triton;
- ``flashmla``: FlashMLA's bf16 sparse kernel and fp8 sparse decode (``flashmla``), SM90 with
  sgl_kernel, bf16 models with 576 / 512 rows.

:func:`choose` is the one choice, made once at start-up by every process that attends (a
holder, the GPU pin's prefill, the SGLang plugin) from the device's capability and the pool
(dtype, widths, row format); :func:`report` logs it once and sets ``kernel_info`` in the
process's ``/metrics``. "auto" takes the highest-priority kernel that runs and fits. Where both
GPU kernels fit a plain pool it returns ``flashmla|triton``, which picks per request by its
rows and heads (:func:`prefer_triton`); the SGLang plugin's device path applies the same rule
to its own FlashMLA call. The per-request choice depends on the request's shape only, so the
gRPC and NVSHMEM paths run the same kernel on the same request and return the same bits.
Kernel modules import lazily: a CPU-only install never loads Triton or sgl_kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from corpusd.kernels import flashmla
from corpusd.kernels.capability import triton_usable
from corpusd.kernels.formats import FP8, PLAIN
from corpusd.kernels.fp8_cache import fp8_partial_attention
from corpusd.kernels.reference import PartialOut, partial_attention

if TYPE_CHECKING:
    from prometheus_client import Gauge

log = logging.getLogger("corpusd.kernels")

KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], PartialOut]


@dataclass(frozen=True, slots=True)
class Kernel:
    """A kernel by ``name``: its function (``partial_attention``'s signature), where it runs
    (``available(device)``, ``needs``: that condition in words), which pools it fits
    (``fits(dtype, d, d_v)``: the model's dtype and row widths; ``formats``: row formats), its
    ``priority`` in "auto", and ``pick(rows, heads)`` for one that chooses per request."""

    name: str
    fn: KernelFn
    available: Callable[[str], bool]
    priority: int
    fits: Callable[[torch.dtype, int, int], bool] = lambda dtype, d, d_v: True
    pick: Callable[[int, int], Kernel] | None = None
    formats: tuple[str, ...] = (PLAIN, FP8)
    needs: str = ""  # where it runs, in words
    fit_needs: str = ""  # which pools it fits, in words
    rule: str = ""  # how ``pick`` chooses, in words (for the log)

    def resolve(self, rows: int, heads: int) -> Kernel:
        """The kernel that runs a request of ``rows`` query rows and ``heads`` heads."""
        return self if self.pick is None else self.pick(rows, heads)

    def misfit(
        self, device: str, dtype: torch.dtype | None, d: int | None, d_v: int | None,
        kv_format: str,
    ) -> str:  # fmt: skip
        """Why this kernel cannot serve the pool on ``device`` ("" when it can), in words a
        user can act on."""
        if kv_format not in self.formats:
            return f"{self.name} does not read {kv_format} rows"
        if dtype is not None and d is not None and d_v is not None and not self.fits(dtype, d, d_v):
            return (
                f"{self.name} needs {self.fit_needs}: it does not fit a {dtype} pool of width {d} "
                f"(d_v {d_v})"
            )
        if not self.available(device):
            return f"{self.name} needs {self.needs}"
        return ""


REGISTRY: dict[str, Kernel] = {}


def register(kernel: Kernel) -> None:
    assert kernel.name not in REGISTRY, f"kernel {kernel.name!r} registered twice"
    REGISTRY[kernel.name] = kernel


def _torch(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    if kv.dtype == torch.uint8:  # fp8 rows
        return fp8_partial_attention(q, kv, indices, scale, d_v)
    return partial_attention(q, kv, indices, scale, d_v)


def _triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    if kv.dtype == torch.uint8:  # fp8 rows
        from corpusd.kernels.triton_fp8 import triton_fp8_partial_attention

        return triton_fp8_partial_attention(q, kv, indices, scale, d_v)
    from corpusd.kernels.triton_mla import triton_partial_attention

    return triton_partial_attention(q, kv, indices, scale, d_v)


register(Kernel("torch", _torch, lambda device: True, priority=0))
register(Kernel("triton", _triton, triton_usable, priority=10, needs="a CUDA GPU and Triton"))
register(
    Kernel(
        "flashmla",
        flashmla.flashmla_partial_attention,
        flashmla.usable,
        priority=20,
        fits=flashmla.fits,
        needs="an SM90 GPU and sgl_kernel",
        fit_needs="a bfloat16 model with 576-wide latent rows (d_v 512)",
    )
)


# Per-request choice between FlashMLA and Triton, from bench/results/gpu-single-h200.json and
# the 1–64-row sweep in gpu-pair-h200x2.json (`kernel_choice`; H200, k 2048; device µs).
# FlashMLA pads heads to 64 or 128 and has a ~65 µs floor per call; Triton runs the real heads:
# - h = 16: Triton 18 vs 68 at 1 row, 55 vs 90 at 64 rows, and within 6 % of FlashMLA up to
#   952 rows (643 vs 690 batched): Triton at h ≤ 16, whatever the rows.
# - h = 64: Triton 28 vs 66 at 1 row, 39 vs 70 at 16; even at 32 (77 vs 77); FlashMLA 82 vs
#   112 at 38 rows.
# - h = 128: Triton 28 vs 66 at 1 row, 34 vs 67 at 8; even at 16 (72 vs 72); FlashMLA 79 vs
#   117 at 32 rows and at every point above.
# So: Triton at h ≤ 16, or at ≤ 16 rows; FlashMLA otherwise. The SGLang device path's own
# measurements (tools/bench_device_path.py --variants, H200, 64 heads) agree: Triton 35.7 vs
# 83.4 µs at 8 rows, FlashMLA 100 vs 108 at 64.
TRITON_MAX_HEADS = 16
TRITON_MAX_ROWS = 16  # for h > 16
PER_REQUEST_RULE = (
    f"triton at h <= {TRITON_MAX_HEADS} or <= {TRITON_MAX_ROWS} rows, flashmla otherwise"
)


def prefer_triton(rows: int, heads: int) -> bool:
    """Whether Triton beats (zero-padded) FlashMLA for a request of this shape on SM90."""
    return heads <= TRITON_MAX_HEADS or rows <= TRITON_MAX_ROWS


def per_request(fast_wide: Kernel, fast_narrow: Kernel) -> Kernel:
    """A kernel that runs ``fast_narrow`` (Triton) where :func:`prefer_triton` says so, else
    ``fast_wide`` (FlashMLA); named ``"<wide>|<narrow>"``, plain rows only (the split was
    measured on bf16 rows)."""

    def pick(rows: int, heads: int) -> Kernel:
        return fast_narrow if prefer_triton(rows, heads) else fast_wide

    def fn(
        q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
    ) -> PartialOut:
        return pick(q.shape[0], q.shape[1]).fn(q, kv, indices, scale, d_v)

    return Kernel(
        f"{fast_wide.name}|{fast_narrow.name}",
        fn,
        lambda device: fast_wide.available(device) and fast_narrow.available(device),
        max(fast_wide.priority, fast_narrow.priority),
        lambda dtype, d, d_v: fast_wide.fits(dtype, d, d_v) and fast_narrow.fits(dtype, d, d_v),
        pick,
        (PLAIN,),
        needs=f"{fast_wide.needs} and {fast_narrow.needs}",
        fit_needs=fast_wide.fit_needs,
        rule=PER_REQUEST_RULE,
    )


def _triton_skip(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> PartialOut:
    if kv.dtype == torch.uint8:  # fp8 rows: no skipping variant
        return _triton(q, kv, indices, scale, d_v)
    from corpusd.kernels.triton_mla import triton_partial_attention

    return triton_partial_attention(q, kv, indices, scale, d_v, skip_empty=True)


#: Triton skipping all-unused index blocks; not registered (``auto`` never picks it): only
#: streams that say their indices are compacted get it (:func:`for_compacted`).
TRITON_SKIP = Kernel("triton+skip", _triton_skip, triton_usable, priority=0,
                     needs="a CUDA GPU and Triton")  # fmt: skip


#: FlashMLA told each row's valid count (``topk_length``), walking those only; not registered
#: (``auto`` never picks it): only streams whose indices are compacted get it
#: (:func:`for_compacted`).
FLASHMLA_LENGTHS = Kernel("flashmla+len", flashmla.flashmla_lengths_partial_attention,
                          flashmla.lengths_usable, priority=0, fits=flashmla.fits,
                          needs="an SM90 GPU and sgl_kernel with topk_length")  # fmt: skip


def for_compacted(kernel: Kernel) -> Kernel:
    """The kernel for requests whose rows' indices come valid first, -1 after, at a fixed width
    (one holder's share of each row's top-k in a graphed step): Triton skipping the blocks of
    -1 for Triton (and for the Triton half of the per-request pair); else ``kernel`` itself
    (every kernel is exact on any layout). FlashMLA stays FlashMLA over the whole width:
    measured on 2 x H200 at 32 rows x 128 heads with half of 2,048 valid (``bench_gpu pair
    --step-only``, bench/results/gpu-pair-step-deferred-h200x2.json), the local half
    compacted and attended by FlashMLA told each row's count (:data:`FLASHMLA_LENGTHS`) took
    160 us where FlashMLA over the whole width took 89 us: the counted kernel saves perhaps
    12 us and the compaction costs more (gpu-pair-step-compaction-h200x2.json); the skipping
    Triton was slower than FlashMLA too, so no caller asks for compacted streams by default."""
    if kernel.name == "triton":
        return TRITON_SKIP
    if kernel.name == "flashmla|triton":
        return per_request(REGISTRY["flashmla"], TRITON_SKIP)
    return kernel


def choose(
    name: str,
    device: str,
    dtype: torch.dtype | None = None,
    d: int | None = None,
    d_v: int | None = None,
    kv_format: str = PLAIN,
) -> Kernel:
    """The kernel that attends a pool of ``kv_format`` rows (the model's ``dtype``, query width
    ``d``, value width ``d_v``; a check skipped when not given) on ``device``.

    ``name`` = a registered kernel, or "auto": the highest-priority kernel available on
    ``device`` that fits the pool, or, for plain rows where both GPU kernels fit, both, chosen
    per request (:func:`per_request`). Raises ValueError naming the choices when the named
    kernel is unknown, unavailable, or does not fit the pool."""
    if name == "auto":
        usable = {
            k.name: k for k in REGISTRY.values() if not k.misfit(device, dtype, d, d_v, kv_format)
        }
        if "flashmla" in usable and "triton" in usable and kv_format == PLAIN:
            return per_request(usable["flashmla"], usable["triton"])
        return max(usable.values(), key=lambda k: k.priority)
    kernel = REGISTRY.get(name)
    if kernel is None:
        raise ValueError(f"unknown kernel {name!r}; registered: {sorted(REGISTRY)}")
    if not kernel.available(device):
        raise ValueError(f"kernel {name!r} is not available on {device}: it needs {kernel.needs}")
    why = kernel.misfit(device, dtype, d, d_v, kv_format)
    if why:
        raise ValueError(f"kernel {name!r}: {why}")
    return kernel


def passed_over(
    chosen: Kernel, device: str, dtype: torch.dtype | None, d: int | None, d_v: int | None,
    kv_format: str = PLAIN,
) -> list[str]:  # fmt: skip
    """Why each kernel of higher priority than ``chosen`` was not chosen, in words."""
    return [
        why
        for k in sorted(REGISTRY.values(), key=lambda k: -k.priority)
        if k.priority > chosen.priority and (why := k.misfit(device, dtype, d, d_v, kv_format))
    ]


_REPORTED: set[tuple[str, str, str]] = set()


def describe(kernel: Kernel, why_not: list[str] | None = None, noun: str = "") -> str:
    """``kernel``'s name (then ``noun``), its per-request rule, and why faster kernels were
    passed over: "flashmla|triton sparse attention (triton at h <= 16 …)"."""
    text = kernel.name + (f" {noun}" if noun else "") + (f" ({kernel.rule})" if kernel.rule else "")
    return text + (f" ({'; '.join(why_not)})" if why_not else "")


def report(kernel: Kernel, device: str, role: str, gauge: Gauge | None = None,
           why_not: list[str] | None = None) -> None:  # fmt: skip
    """Log the choice once per process, role and device, and set ``gauge`` (a process's
    ``kernel_info{kernel, device}``, :meth:`corpusd.metrics.Metrics.kernel_info`) to 1."""
    key = (role, kernel.name, device)
    if key not in _REPORTED:
        _REPORTED.add(key)
        log.info("%s on %s: %s", role, device, describe(kernel, why_not, "attention partials"))
    if gauge is not None:
        gauge.labels(kernel.name, device).set(1)
