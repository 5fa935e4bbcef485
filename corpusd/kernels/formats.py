"""The latent-row formats every attention-partial kernel reads, defined once.

A latent row is ``c_KV ‖ k_pe``: ``D_V`` = 512 values (kv_lora_rank, also O's width) and
``D_ROPE`` = 64 rope values, ``D_QK`` = 576 in all (the absorbed query's width). A pool stores
rows in one of :data:`KV_FORMATS`: ``plain`` (the model's dtype, ``[N, 576]``) or ``fp8_e4m3``,
FlashMLA's 656-byte row (``corpusd/kernels/fp8_cache.py`` documents its bytes):

    bytes   0 … 511   c_KV as float8_e4m3fn, 4 tiles of 128 values
    bytes 512 … 527   4 float32 scales, one per tile
    bytes 528 … 655   k_pe as bfloat16
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports these names; torch only where a kernel runs
    import torch

D_V = 512  # c_KV: the values, kv_lora_rank
D_ROPE = 64  # k_pe: qk_rope_head_dim
D_QK = D_V + D_ROPE  # 576
TILE = 128  # fp8 values sharing one scale
N_TILES = D_V // TILE
SCALE_AT = D_V  # byte offset of the 4 float32 scales in an fp8 row
ROPE_AT = SCALE_AT + 4 * N_TILES  # byte offset of the bf16 rope part
ROW_BYTES = ROPE_AT + 2 * D_ROPE  # 656: one fp8 row
FP8_MAX = 448.0  # largest float8_e4m3fn

PLAIN, FP8 = "plain", "fp8_e4m3"
KV_FORMATS = (PLAIN, FP8)

FP8_BLOCK = 64  # rows of one FlashMLA fp8 cache block: an fp8 pool holds whole blocks
TOPK_ALIGN = 128  # FlashMLA's top-k width is a multiple of this (SM90)


def valid_first(idx: torch.Tensor) -> torch.Tensor:
    """``idx [n, k]`` (-1 unused) with each row's valid entries first, in their order, and -1
    after, at the same width: ``requester.plan.compact`` for a CUDA graph (no trim, no host
    sync). A holder told a stream is ``compacted`` walks only each row's valid entries
    (``registry.for_compacted``)."""
    import torch

    order = (idx < 0).to(torch.int8).argsort(dim=1, stable=True)
    return idx.gather(1, order)
