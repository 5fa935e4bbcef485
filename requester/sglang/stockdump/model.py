"""SGLang's own ``DeepseekV32ForCausalLM``, unchanged but for hooks that record each forward's
last rows per layer (:mod:`requester.sglang.dump`): the stock side of a layer-by-layer comparison.

The selection is read where SGLang makes it, ``NSAIndexerMetadata.topk_transform``, on its
unfused path (``SGLANG_NSA_FUSE_TOPK=0``, as the plugin runs): ``fast_topk_v2`` returns each
row's sequence positions, where the fused path returns page-table rows. Both run the same radix
select (``fast_topk_cuda_tl`` in sgl-kernel's topk.cu), so the positions are the ones the fused
path would have mapped.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from sglang.srt.layers.attention.nsa_backend import NSAIndexerMetadata
from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM as _SGLangDeepseekV32

from requester.sglang import dump

os.environ.setdefault("SGLANG_NSA_FUSE_TOPK", "0")
_LAYER: list[int] = []  # the layer whose indexer is selecting (set by the instance hooks)
_DUMPERS: list[dump.Dumper] = []  # this process's model's


def _record_topk(cls: Any) -> None:
    """Wrap ``cls.topk_transform`` once: record the result with its logits for the current layer
    (this process serves only the dumping model)."""
    if getattr(cls, "_corpusd_dumped", False):
        return
    orig = cls.topk_transform

    def topk_transform(self: Any, logits: Any, topk: int, ks: Any = None, **kw: Any) -> Any:
        out = orig(self, logits, topk, ks=ks, **kw)
        if _LAYER and _DUMPERS and _DUMPERS[0].rids:
            lengths = kw.get("ke_offset")
            if lengths is None:
                lengths = self.get_seqlens_expanded()
            dump.stock_selection(_DUMPERS[0], _LAYER[-1], logits, lengths, ks, out)
        return out

    cls.topk_transform = topk_transform
    cls._corpusd_dumped = True


def _hook_indexer(ix: Any) -> None:
    for name in ("_get_topk_paged", "_get_topk_ragged"):
        orig = getattr(ix, name)

        def hooked(*args: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> Any:
            a = args[1:] if _name == "_get_topk_ragged" else args  # (forward_batch, layer_id, …)
            _LAYER.append(int(a[1]))
            try:
                return _orig(*args, **kw)
            finally:
                _LAYER.pop()

        setattr(ix, name, hooked)


class DeepseekV32ForCausalLM(_SGLangDeepseekV32):
    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        out = dump.dump_dir()
        if out is None:
            raise RuntimeError(
                f"requester.sglang.stockdump records layers: set {dump.ENV_DUMP} to a directory"
            )
        if os.environ["SGLANG_NSA_FUSE_TOPK"].lower() in ("1", "true"):
            raise RuntimeError("requester.sglang.stockdump: set SGLANG_NSA_FUSE_TOPK=0")
        self.corpusd_dumper = dump.Dumper(out)
        _DUMPERS[:] = [self.corpusd_dumper]
        dump.install(self, self.corpusd_dumper)
        _record_topk(NSAIndexerMetadata)
        for layer in self.model.layers:
            ix = getattr(getattr(layer, "self_attn", None), "indexer", None)
            if ix is not None:
                _hook_indexer(ix)

    def forward(
        self, input_ids: Any, positions: Any, forward_batch: Any, input_embeds: Any = None,
        pp_proxy_tensors: Any = None,
    ) -> Any:  # fmt: skip
        live = not forward_batch.forward_mode.is_idle()
        live = live and not torch.cuda.is_current_stream_capturing()
        if live:
            dump.begin_forward(self.corpusd_dumper, forward_batch)
        try:
            return super().forward(
                input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors
            )
        finally:
            if live:
                self.corpusd_dumper.end()


EntryClass = [DeepseekV32ForCausalLM]
