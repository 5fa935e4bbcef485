"""corpusd inside SGLang: SGLang workers as requesters of a pinned corpus (issue 7).

Load with ``SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang``. SGLang then imports every module of
this package in each scheduler process (``models/registry.py: import_model_classes``); the entry
module (:mod:`requester.sglang.deepseek_v32`) replaces the ``nsa`` attention backend factory and
registers ``DeepseekV32ForCausalLM``. Pure logic (LSE conventions, merge, positions, rope layout,
combined top-k, binding, page hashes, host page layout) lives in modules that import neither
sglang nor CUDA, so CPU tests cover it. Hook points in SGLang 0.5.10.post1: ``NOTES.md``.

This package imports nothing from sglang itself; only the glue modules do, lazily.
"""
