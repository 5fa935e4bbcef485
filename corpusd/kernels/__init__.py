"""Attention partials, in one package: every kernel that computes a partial ``(O, LSE)`` of
query rows over latent pool rows, the rule that chooses one, and what they share.

- ``formats``: the row formats (D_QK 576, D_V 512, FlashMLA's 656-byte fp8 row), defined once;
- ``reference``: ``partial_attention``, the torch reference, and ``PartialOut``, a kernel's
  result; ``fp8_cache``: fp8 rows (quantize, dequantize, the torch reference over them);
- ``merge``: the exact LSE merge of partials;
- ``flashmla``: FlashMLA's bf16 sparse kernel and fp8 sparse decode (head padding, index
  preparation, the LSE-base probe);
- ``triton_common`` / ``triton_mla`` / ``triton_fp8``: our Triton kernels over plain and fp8
  rows, sharing their prologue;
- ``registry``: the kernels by name and the one capability-based choice (``choose``,
  ``prefer_triton``), reported in logs and ``/metrics``; ``capability``: what a device can run.

Used by the holder (its pool), the model and the GPU pin's prefill (``corpusd.model``), and the
SGLang plugin (``requester/sglang``). This ``__init__`` imports nothing, so that importing the
formats never loads a kernel.
"""
