"""Names the model, the corpus and the CLI share: how a page's latent rows are stored and which
prefill kernels a pin may ask for.

Torch-free and first-party-free on purpose: the CLI builds its flags from these without
importing the model, and both ``corpusd.model`` (which reads and writes the rows) and
``corpusd.corpus`` (whose manifest records the format) import them from here, so neither
sub-package has to import the other for a name.
"""

from __future__ import annotations

#: how latent rows are stored: "plain" rows of ``kv_dim`` values in the manifest's dtype, or
#: FlashMLA's 656-byte fp8 rows (``corpusd/model/fp8_cache.py``; index keys stay in the dtype)
KV_FORMATS = ("plain", "fp8_e4m3")
FP8_ROW_BYTES = 656  # 512 fp8 values, 4 float32 scales, 64 bf16 rope values
#: ``corpusd pin --kernels``: what ``corpusd.model.kernels.choose`` accepts
KERNELS = ("auto", "torch")
