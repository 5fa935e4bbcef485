"""Stock SGLang with per-layer dumps (``requester/sglang/dump.py``) and nothing of corpusd's path:
``SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang.stockdump`` with ``CORPUSD_SGLANG_DUMP`` set
(``tools/diag_layer_diff.py`` starts it so)."""
