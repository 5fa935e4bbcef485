"""Names the model, the corpus and the CLI share: which prefill kernels a pin may ask for, and
(re-exported) how a page's latent rows are stored.

Torch-free and first-party-light on purpose: the CLI builds its flags from these without
importing the model, and both ``corpusd.model`` and ``corpusd.corpus`` read them from here, so
neither sub-package has to import the other for a name. The row formats are defined once, in
``corpusd/kernels/formats.py`` (torch-free too: ``corpusd.kernels``' ``__init__`` imports
nothing); ``KV_FORMATS`` is that tuple, not a copy.
"""

from __future__ import annotations

from corpusd.kernels.formats import KV_FORMATS

__all__ = ["KERNELS", "KV_FORMATS"]

#: ``corpusd pin --kernels``: what ``corpusd.model.prefill_kernels.choose`` accepts
KERNELS = ("auto", "torch")
